"""Relative weight error of each 4-bit format on Gaussian and heavy-tailed weights (CPU).

    python -m bench.format_error > bench/results/format_error.md
"""

import platform
import time

import torch

from qerl_kit.formats import FORMATS


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = {
        "gaussian 4096x4096": torch.randn(4096, 4096, generator=g),
        "gaussian, row scales ~ lognormal(0, 1)": torch.randn(4096, 4096, generator=g)
        * torch.exp(torch.randn(4096, 1, generator=g)),
        "student-t (3 dof) 4096x4096": torch.distributions.StudentT(3.0).sample((4096, 4096)),
    }
    print(f"Relative Frobenius error ||W - deq(q(W))|| / ||W||, fp32 weights, "
          f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {platform.machine()} CPU.\n")
    print("| weights | " + " | ".join(f"{n} ({f.bits_per_weight:g} bits)" for n, f in FORMATS.items()) + " |")
    print("|---|" + "---|" * len(FORMATS))
    for name, w in cases.items():
        print(f"| {name} | " + " | ".join(f"{f.error(w):.4f}" for f in FORMATS.values()) + " |")


if __name__ == "__main__":
    main()
