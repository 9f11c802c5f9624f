"""From a config to objects: the policy (quantized base + LoRA), its tokenizer, the datasets.

``build_policy(ModelConfig)`` loads the base (the shipped tiny model, a ``qerl_kit.models``
preset, or a local Hugging Face directory), quantizes it to the configured format, and attaches
LoRA. ``build_datasets(DataConfig)`` returns (train, eval) lists of rows with ``prompt`` and
``answer``, and the reward functions that fit them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qerl_kit.config import DataConfig, ModelConfig


def load_base(cfg: ModelConfig, dtype: torch.dtype | None = None):
    """(model, tokenizer) for ``cfg.name``, not yet quantized."""
    from transformers import AutoTokenizer

    from qerl_kit.models import PRESETS, load_model

    if cfg.name == "tiny":
        from qerl_kit.tiny import load_tiny

        return load_tiny()
    if cfg.name in PRESETS:
        raise ValueError(f"model preset {cfg.name!r} has random weights and no tokenizer; "
                         "train with 'tiny' or a local Hugging Face model directory")
    if not Path(cfg.name).exists():
        raise FileNotFoundError(
            f"model {cfg.name!r} is not a local directory; download it first (e.g. "
            f"`huggingface-cli download {cfg.name} --local-dir models/{Path(cfg.name).name}`) "
            "and point model.name at that directory")
    model = load_model(cfg.name, dtype=dtype or "auto", trust_remote_code=cfg.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(cfg.name, trust_remote_code=cfg.trust_remote_code)
    return model, tokenizer


def build_policy(cfg: ModelConfig, seed: int = 0):
    """(peft model, tokenizer, quantization report or None): quantize, then attach LoRA."""
    from qerl_kit.lora import attach_lora
    from qerl_kit.quantize import quantize_model

    model, tokenizer = load_base(cfg)
    report = None if cfg.format == "none" else quantize_model(model, fmt=cfg.format)
    policy = attach_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, train_norms=cfg.train_norms, seed=seed)
    return policy, tokenizer, report


def build_datasets(cfg: DataConfig, seed: int = 0):
    """(train rows, eval rows, reward functions) for ``cfg.dataset``.

    ``seed`` only picks which synthetic problems are generated; runs that compare training seeds
    should keep it fixed so that every run sees the same held-out problems.
    """
    from qerl_kit import rewards

    name = cfg.dataset
    if name == "arith":
        from qerl_kit.tasks.arith import make_dataset

        train = make_dataset("train", cfg.train_size, seed=seed)
        evals = make_dataset("test", cfg.eval_size, seed=seed)
        return train, evals, [rewards.gsm8k_reward]
    from qerl_kit.data import load_gsm8k, load_math500

    if name == "gsm8k":
        train, evals = load_gsm8k("train"), load_gsm8k("test")
        return train, evals[:cfg.eval_size], [rewards.gsm8k_reward]
    if name == "math500":
        evals = load_math500("test")
        return evals, evals[:cfg.eval_size], [rewards.math_reward]
    path = Path(name)
    if path.suffix == ".jsonl" and path.exists():
        train = load_gsm8k(str(path))
        evals = load_gsm8k(cfg.eval_dataset) if cfg.eval_dataset else train[-cfg.eval_size:]
        return train, evals[:cfg.eval_size], [rewards.gsm8k_reward]
    raise ValueError(f"unknown dataset {name!r}: use arith, gsm8k, math500 or a GSM8K-style .jsonl path")
