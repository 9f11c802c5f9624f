"""Our own rollout engine: static KV cache, shared prefill, on-device sampling, CUDA-graph decode.

``StaticEngine(model, tokenizer)`` is a backend of ``qerl_kit.rollout``'s interface for Qwen2,
Qwen3 and Llama-style models (bf16 or NVFP4, with unmerged LoRA and AQN); see
``qerl_kit.engine.engine`` for how a call runs and docs/rollout.md for measured speed.
"""

from qerl_kit.engine.decoder import Decoder, KVCache
from qerl_kit.engine.engine import StaticEngine
from qerl_kit.engine.sampler import process_logits, sample

__all__ = ["StaticEngine", "Decoder", "KVCache", "process_logits", "sample"]
