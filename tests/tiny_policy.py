"""The tests' tiny trainable policy: qwen2-tiny, quantized, with a LoRA adapter whose B is random.

peft starts lora_B at zeros, so a fresh adapter is a no-op: the policy equals the reference and
the first update's LoRA-A gradients are zero. A random B (``random_b``) makes the policy differ from
its base and every update change the log-probs. ``head_scale`` sharpens the output head (before
LoRA is attached) so that a tiny model's sampling is not uniform.
"""

import torch

from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model


def tiny_policy(fmt: str = "nvfp4", *, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32,
                dropout: float = 0.0, random_b: bool = True, head_scale: float | None = None):
    """qwen2-tiny (``seed``, ``dtype``, ``device``), its projections in ``fmt``, LoRA r=4; lora_B
    drawn from N(0, 0.05^2) with one generator seeded ``seed + 1`` when ``random_b``."""
    model = build_model("qwen2-tiny", seed=seed, dtype=dtype, device=device)
    quantize_model(model, fmt=fmt)
    if head_scale is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model = attach_lora(model, r=4, seed=seed, dropout=dropout)
    if random_b:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p))
    return model
