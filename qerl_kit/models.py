"""Model configs by name: small random models for tests and demos, real shapes for benchmarks.

``build_model("qwen2-tiny")`` builds a randomly initialised Hugging Face causal LM from a preset;
the real-architecture presets (``"Qwen2.5-7B"`` ...) carry the published shapes so that speed and
memory can be measured without downloading weights. ``load_pretrained(source)`` loads a real
model and its tokenizer from a local Hugging Face directory (an NVFP4 compressed-tensors export of
``qerl_kit.export`` included: loaded as NVFP4 layers), a llama.cpp ``.gguf`` file or a hub id (when
online), remote code off; ``check_model_source`` says which, or why not, before anything slow. A model
directory must hold its tokenizer and readable weight files (``check_tokenizer_files``,
``check_weight_files``) and a config.json whose sizes are positive ints (``read_model_config``).
Every load checks the weights are finite (``qerl_kit.finite.check_weights``: names the tensor and
the source).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch

from qerl_kit.config_types import nearest, short_repr
from qerl_kit.finite import check_weights
from qerl_kit.model_files import (ModelSourceError, check_tokenizer_files, check_weight_files, is_nvfp4_checkpoint,
                                  read_model_config)

# Shapes from the models' published config.json files.
_QWEN25 = dict(arch="qwen2", vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
               max_position_embeddings=32768, tie_word_embeddings=False)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-tiny": dict(arch="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512),
    "qwen3-tiny": dict(arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=512),
    "llama-tiny": dict(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512),
    "Qwen2.5-0.5B": dict(_QWEN25, vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4),
    "Qwen2.5-14B": dict(_QWEN25, vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8),
    "Qwen2.5-32B": dict(_QWEN25, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8),
    "Qwen2.5-72B": dict(_QWEN25, vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
}


def make_config(name: str, **overrides):
    """A transformers config for preset ``name`` (see ``PRESETS``), with keyword overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    spec = {**PRESETS[name], **overrides}
    arch = spec.pop("arch")
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig}[arch]
    return cls(**spec)


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", **overrides):
    """A randomly initialised causal LM from a preset (seeded), in eval mode."""
    from transformers import AutoModelForCausalLM

    from qerl_kit.config_types import check_seed

    seed = check_seed("seed", seed)  # torch's generator seed rule: an int in [0, 2**63 - 1]
    config = make_config(name, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


# The names ``build.load_base`` (train, eval, demo) takes besides model sources: the shipped tiny model.
BASE_NAMES = ("tiny",)


def describe_sources(presets: Iterable[str] = ()) -> str:
    names = ", ".join(repr(p) for p in presets)
    return ((f"one of {names}, " if names else "") + "a local Hugging Face model directory, a llama.cpp .gguf "
            "file, or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct' (when online)")


def check_model_source(name: str | os.PathLike, presets: Iterable[str] = ()) -> str:
    """Where ``name`` loads from: "preset" (one of ``presets``, the names the caller builds itself),
    "gguf", "dir" or "hub"; else a ``ModelSourceError`` naming ``name`` and what is accepted, for a
    missing path, a file that is not .gguf, a name close to a preset (a typo, never a hub lookup), an
    architecture preset where the caller takes none, or a hub id while offline. Cheap: every command
    that takes a model calls it before anything slow (the task's data, a quantization)."""
    from qerl_kit.gguf_model import check_gguf_header, is_gguf_path

    presets = tuple(presets)
    text = str(name)
    shown = short_repr(text, 300)
    if text in presets:
        return "preset"
    if text in PRESETS:
        raise ModelSourceError(f"model {shown} is an architecture preset with random weights and no tokenizer; "
                               f"expected {describe_sources(presets)}")
    path = Path(text).expanduser()
    if is_gguf_path(text):
        check_gguf_header(path)  # exists, is GGUF, an architecture we run (truncation: when it loads)
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSourceError(f"model {shown}: the directory has no config.json; expected "
                                   f"{describe_sources(presets)}")
        read_model_config(path)  # bad JSON or a size no model can have: said before anything slow
        return "dir"
    if path.exists():
        raise ModelSourceError(f"model {shown} is a file but not a .gguf file; expected {describe_sources(presets)}")
    # Not here. Local, not a hub id, when it is written as a path, when its first folder exists here
    # ("runs/nope" with runs/ present), or when it is one typo away from a name this command takes.
    known = list(presets) + list(PRESETS)
    close = nearest(text, known, cutoff=0.75) if "/" not in text else None
    first = text.split("/", 1)[0]
    looks_local = (text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep in text.replace("/", "")
                   or ("/" in text and Path(first).expanduser().is_dir()) or bool(close))
    if looks_local or _offline():
        why = "no such file or directory" + ("" if looks_local else " (and the hub is off: HF_HUB_OFFLINE is set)")
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ModelSourceError(f"model {shown}: {why}{hint}; expected {describe_sources(presets)}")
    return "hub"


def load_pretrained(name: str | os.PathLike, *, dtype: torch.dtype | str = "auto",
                    device: str | torch.device | None = None, trust_remote_code: bool = False):
    """``(model, tokenizer)`` from a local HF directory, a ``.gguf`` file (``qerl_kit.gguf_model``:
    dequantized to bf16 unless ``dtype`` says otherwise; on this project's CPUs bf16 decodes twice
    as fast as float32) or a hub id (when online), in eval mode,
    on ``device`` (default: the CPU). Remote code stays off unless asked for."""
    from transformers import AutoTokenizer

    kind = check_model_source(name)
    if kind == "gguf":
        from qerl_kit.gguf_model import load_gguf

        model, tokenizer = load_gguf(Path(str(name)).expanduser(), dtype=torch.bfloat16 if dtype == "auto" else dtype,
                                     device=device)
        return model, tokenizer  # its weights checked finite by load_gguf
    source = str(Path(str(name)).expanduser()) if kind == "dir" else str(name)
    if kind == "dir":  # before minutes of loading: the tokenizer is there, no weight file is truncated
        check_tokenizer_files(source)
        check_weight_files(source)
    try:
        if kind == "dir" and is_nvfp4_checkpoint(read_model_config(source)):  # our export: NVFP4Linear layers
            from qerl_kit.export import load_nvfp4

            model = load_nvfp4(source, dtype=torch.bfloat16 if dtype == "auto" else dtype)
        else:
            model = load_model(source, dtype=dtype, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ModelSourceError:
        raise
    except OSError as e:  # a hub id that does not resolve, no network: one clear line, not a traceback
        raise ModelSourceError(f"model {short_repr(str(name), 300)} could not be loaded ({str(e)[:300]}); "
                               f"expected {describe_sources()}") from e
    from qerl_kit.gguf_model import add_turn_end

    add_turn_end(model, tokenizer)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def load_model(path: str, dtype: torch.dtype | str = "auto", trust_remote_code: bool = False, **kwargs):
    """A causal LM from a local HF directory or hub id (``from_pretrained`` with safetensors only and
    remote code off by default) or from a ``.gguf`` file (``qerl_kit.gguf_model.load_gguf``)."""
    from qerl_kit.gguf_model import is_gguf_path, load_gguf

    if is_gguf_path(path):
        return load_gguf(path, dtype=torch.bfloat16 if dtype == "auto" else dtype)[0]  # checked finite there
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                 trust_remote_code=trust_remote_code, **kwargs)
    check_weights(model, str(path))  # every format, "none" included (the quantizer checks only what it converts)
    return model
