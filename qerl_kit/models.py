"""Model configs by name: small random models for tests and demos, real shapes for benchmarks.

``build_model("qwen2-tiny")`` builds a randomly initialised Hugging Face causal LM from a preset;
the real-architecture presets (``"Qwen2.5-7B"`` ...) carry the published shapes so that speed and
memory can be measured without downloading weights. ``load_model(path_or_name)`` loads a saved
model through ``AutoModelForCausalLM.from_pretrained`` with ``trust_remote_code`` off.
"""

from __future__ import annotations

from typing import Any

import torch

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

    config = make_config(name, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_model(path: str, dtype: torch.dtype | str = "auto", trust_remote_code: bool = False, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` with safetensors only and remote code off by default."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True,
                                                trust_remote_code=trust_remote_code, **kwargs)
