"""The main job, as far as the toolkit goes today: quantize a model to 4 bits and show what changed.

It builds (or loads) a causal LM, measures next-token logits, converts every linear layer to the
chosen format, and prints the per-layer report, the memory by kind, the relative error of each
4-bit format on the model's weights, and how far the quantized logits moved. The full QeRL run
(LoRA + AQN + GRPO on the shipped tiny model) replaces this body as those pieces land.
"""

from __future__ import annotations

import time

import torch


def run_demo(model: str = "qwen2-tiny", fmt: str = "nvfp4", seed: int = 0) -> dict:
    from qerl_kit.formats import FORMATS
    from qerl_kit.models import PRESETS, build_model, load_model
    from qerl_kit.quantize import memory_report, quantize_model
    from qerl_kit.table import text_table

    start = time.perf_counter()
    if model in PRESETS:
        lm = build_model(model, seed=seed, dtype=torch.bfloat16, hidden_size=256,
                         intermediate_size=704, num_hidden_layers=4) if model.endswith("-tiny") \
            else build_model(model, seed=seed, dtype=torch.bfloat16)
    else:
        lm = load_model(model)
    ids = torch.randint(0, lm.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(seed))
    weights = [m.weight.detach() for name, m in lm.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
    fmt_rows = []
    for name, spec in FORMATS.items():
        errs = [spec.error(w) for w in weights if w.shape[1] % spec.block_size == 0]
        fmt_rows.append({"format": name, "bits/weight": spec.bits_per_weight,
                         "mean rel. weight error": sum(errs) / len(errs), "blocks": spec.description})
    with torch.no_grad():
        ref = lm(ids).logits.float()
    report = quantize_model(lm, fmt=fmt)
    with torch.no_grad():
        out = lm(ids).logits.float()
    logit_err = ((out - ref).norm() / ref.norm()).item()
    top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(report)
    print("\nmemory by kind after quantization:")
    print(memory_report(lm))
    print("\n4-bit formats on this model's weights:")
    print(text_table(fmt_rows))
    print(f"\nlogits: relative error {logit_err:.4f}, top-1 agreement {top1:.1%} "
          f"(random-weight model; a trained model agrees far more)")
    result = {"layers": len(report.layers), "compression": report.compression,
              "logit_rel_error": logit_err, "top1_agreement": top1,
              "wall_seconds": time.perf_counter() - start}
    print(f"done in {result['wall_seconds']:.1f} s")
    return result
