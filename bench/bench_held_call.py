"""Host time of one held 4-bit call against ``nn.Linear``'s, same run (the update pass's per-call cost).

A small model's update pass is bound by the host's work per call (``bench/results/host_pass_cpu.md``).
This times one projection's forward with gradient on, inside an open dense-weight block, three ways in
alternating rounds: ``nn.Linear``; the NVFP4 layer's held path as it is (its buffers read from
``_buffers``); and the same held path with every buffer read through the module's attributes, as it
was before (each through ``QuantLinear.__getattr__`` and ``Module.__getattr__``; the bias cast on every
call). Prints microseconds per call (median of the rounds).

    OMP_NUM_THREADS=1 python -m bench.bench_held_call [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from qerl_kit import kernels
from qerl_kit.dense_cache import dense_weight_cache
from qerl_kit.linear import NVFP4Linear, QuantLinear


@contextlib.contextmanager
def attribute_reads():
    """The held path with its buffers read through the module's attributes (the code before _buffers)."""
    held, forward_held = NVFP4Linear._held, QuantLinear._forward_held

    def _held(self, x2):
        return kernels.held_weight(x2, self.packed, self.scales, self.global_scale)

    def _forward_held(self, x):
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        w = self._held(x2)
        if w is None:
            return None
        y = F.linear(x2, w, None if self.bias is None else self.bias.to(x.dtype))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    NVFP4Linear._held, QuantLinear._forward_held = _held, _forward_held
    try:
        yield
    finally:
        NVFP4Linear._held, QuantLinear._forward_held = held, forward_held


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def run(calls: int = 20000, rounds: int = 5, width: int = 64) -> dict[str, float]:
    """Median microseconds per call of each way, over ``rounds`` alternating rounds (after a warm-up)."""
    torch.manual_seed(0)
    linear = nn.Linear(width, width).requires_grad_(False)
    quant = NVFP4Linear.from_linear(linear)
    x = torch.randn(4, width, width, requires_grad=True)
    ways = {"nn.Linear": (linear, contextlib.nullcontext), "NVFP4 held, _buffers": (quant, contextlib.nullcontext),
            "NVFP4 held, attribute reads": (quant, attribute_reads)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    with dense_weight_cache():
        for r in range(rounds + 1):
            for name, (layer, patch) in ways.items():
                with patch():
                    us = per_call_us(lambda: layer(x), calls)
                if r:  # round 0 warms up
                    times[name].append(us)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    res = run(a.calls, a.rounds)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), a 64 x 64 layer, 3-D input with gradient, "
          f"{a.calls} calls x {a.rounds} rounds\n\n| call | us per call (median) | vs nn.Linear |\n|---|---:|---:|")
    for name, us in res.items():
        print(f"| {name} | {us:.1f} | {us / res['nn.Linear']:.2f}x |")


if __name__ == "__main__":
    main()
