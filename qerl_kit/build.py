"""From a config to the policy: the base model (quantized) with LoRA, and its tokenizer.

``build_policy(ModelConfig, device=, dtype=)`` loads the base (the shipped tiny model, or a local
Hugging Face directory, a ``.gguf`` file or a hub id), moves it to ``device`` in compute dtype ``dtype``, quantizes it to the
configured format there, and attaches LoRA. The task (rows, rewards, prompts) comes from
``qerl_kit.tasks.make_task(DataConfig)``.
"""

from __future__ import annotations

import torch

from qerl_kit.config import ModelConfig

__all__ = ["load_base", "quantize_base", "build_policy"]


def load_base(cfg: ModelConfig, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
    """(model, tokenizer) for ``cfg.name``, not yet quantized, on ``device`` (default: the CPU) in
    ``dtype`` (default: float32 for the tiny model, the checkpoint's own dtype otherwise)."""
    from qerl_kit.models import BASE_NAMES, check_model_source, load_pretrained

    if check_model_source(cfg.name, presets=BASE_NAMES) == "preset":  # a typo or a missing path fails here
        from qerl_kit.tiny import load_tiny

        return load_tiny(dtype=dtype or torch.float32, device=device or "cpu")
    return load_pretrained(cfg.name, dtype=dtype or "auto", device=device, trust_remote_code=cfg.trust_remote_code)


def quantize_base(model, fmt: str, key: str = "model.format", name: str = "the model"):
    """Quantize a loaded base to ``fmt`` unless it is a bf16 run (``none``) or already in ``fmt``; the
    quantization report, or None. A base that loads already quantized (an NVFP4 export, ``qerl
    quantize --out``) is used as it is; asking it for another format is a ``ConfigError`` naming
    ``key`` (``--format`` for the CLI), not a second quantization."""
    from qerl_kit.config_types import ConfigError
    from qerl_kit.formats import DENSE
    from qerl_kit.quantize import quantize_model, quantized_format

    have = quantized_format(model)
    if have is not None and fmt not in (have, DENSE):
        raise ConfigError(f"{key} {fmt}: {name} is already quantized to {have}; use {key} {have}", key, fmt, have)
    return None if fmt == DENSE or have is not None else quantize_model(model, fmt=fmt)


def check_kernels(value: str, device: str | torch.device | None) -> None:
    """Refuse, before anything loads, a ``model.kernels`` that forces kernels the policy's device cannot
    run (each 4-bit matmul would raise at its first call): GPU kernels on the CPU (outside Triton's
    interpreter), humming where humming-kernels is not installed."""
    import importlib.util

    from qerl_kit.config_types import _bad
    from qerl_kit.kernels.backend import interpreting

    if value in ("ours", "triton", "humming") and torch.device(device or "cpu").type != "cuda" and not interpreting():
        raise _bad("model.kernels", value, "null, 'auto' or 'reference' on the CPU",
                   f"{value!r} forces GPU kernels; the CPU runs the plain-PyTorch path, bit-reproducible already")
    if value == "humming" and importlib.util.find_spec("humming") is None:
        raise _bad("model.kernels", value, "null, 'auto', 'ours', 'triton' or 'reference' here",
                   "humming-kernels is not installed")


def build_policy(cfg: ModelConfig, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 seed: int = 0):
    """(peft model, tokenizer, quantization report or None): load on ``device``, quantize, attach LoRA.

    ``seed`` seeds LoRA's initialization, so runs with the same seed start from the same adapter.
    ``cfg.kernels``, when set, becomes the process's kernel backend (``kernels.set_backend``: every
    4-bit matmul of the process, this policy's and any other's)."""
    from qerl_kit.config_types import check_seed
    from qerl_kit.kernels import set_backend
    from qerl_kit.lora import attach_lora

    seed = check_seed("seed", seed)  # LoRA's init generator: refused before the model loads
    if cfg.kernels is not None:
        check_kernels(cfg.kernels, device)
        set_backend(cfg.kernels)
    model, tokenizer = load_base(cfg, device=device, dtype=dtype)
    report = quantize_base(model, cfg.format, name=f"model {cfg.name}")
    policy = attach_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, train_norms=cfg.train_norms, seed=seed)
    return policy, tokenizer, report
