"""Our own rollout engine: static KV cache, shared prefill, on-device sampling, CUDA-graph decode.

``StaticEngine(model, tokenizer)`` is a backend of ``qerl_kit.rollout``'s interface for Qwen2,
Qwen3 and Llama-style models (bf16 or NVFP4, with unmerged LoRA and AQN); see
``qerl_kit.engine.engine`` for how a call runs and docs/rollout.md for measured speed.
"""

from qerl_kit.engine.decoder import Decoder, KVCache
from qerl_kit.engine.engine import StaticEngine
from qerl_kit.engine.sampler import process_logits, sample

__all__ = ["StaticEngine", "Decoder", "KVCache", "process_logits", "sample", "make_engine"]


def make_engine(name: str, model, tokenizer, **kwargs):
    """The rollout engine ``rollout.engine`` names: ``static`` (StaticEngine), ``hf``
    (transformers' generate), or ``auto``: StaticEngine when the model is on a GPU and its layout
    is one the engine knows, else HFEngine (on the CPU generate is as fast for small models)."""
    from qerl_kit.rollout import HFEngine

    if name == "hf":
        return HFEngine(model, tokenizer, **kwargs)
    if name == "static":
        return StaticEngine(model, tokenizer, **kwargs)
    if name != "auto":
        raise ValueError(f"unknown rollout engine {name!r}: use auto, static or hf")
    on_gpu = any(p.is_cuda for p in model.parameters())
    if on_gpu:
        try:
            return StaticEngine(model, tokenizer, **kwargs)
        except (TypeError, NotImplementedError):
            pass  # a layout the engine does not cover: generate handles any model
    return HFEngine(model, tokenizer, **kwargs)
