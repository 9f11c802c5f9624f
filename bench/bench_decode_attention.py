"""Decode attention, one layer: the split-KV Triton kernel (shared prompt prefix, and the plain
layout) against ``scaled_dot_product_attention`` on the plain layout (the engine's path before),
inside CUDA graphs, at the Qwen2.5 shapes, with the bytes each must read.

    python -m bench.bench_decode_attention --out OUT      # the H200 run (seconds)

Rows are GRPO groups: ``batch / n`` prompts of ``--prompt`` tokens, ``n`` rows each; ``own`` is
how many completion tokens each row has so far (the key length is prompt + own). The floor is the
KV bytes read once (prompt part once per prompt with the shared prefix; once per row without) at
the same-run copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import graph_us
from qerl_kit.kernels.decode_attention import Prefix, decode_attention

SHAPES = {"Qwen2.5-7B": (4, 7, 128), "Qwen2.5-32B": (8, 5, 128)}  # kv heads, query heads per kv head, head dim


def timed(fn, reps: int = 200) -> float:
    """Microseconds per call of ``fn`` captured in a CUDA graph of ``reps`` calls."""
    return graph_us(fn, reps, replays=3)


def copy_bandwidth() -> float:
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda: b.copy_(a), reps=20)
    return 2 * a.numel() * 4 / (us * 1e-6)


def case(model: str, batch: int, n: int, prompt: int, own: int, new: int, bw: float) -> dict:
    kvh, G, D = SHAPES[model]
    dev, dt = "cuda", torch.bfloat16
    B, L = batch // n, prompt + own
    q = torch.randn(batch, kvh, G, D, device=dev, dtype=dt)
    k = torch.randn(batch, kvh, new, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    pk = torch.randn(B, kvh, prompt, D, device=dev, dtype=dt)
    pv = torch.randn_like(pk)
    pre = Prefix(pk, pv, torch.arange(B, device=dev).repeat_interleave(n))
    bias = torch.zeros(batch, prompt + new, device=dev, dtype=dt)
    bias[:, L:] = float("-inf")
    plain_k = torch.cat([pk[pre.prompt_row], k], 2)
    plain_v = torch.cat([pv[pre.prompt_row], v], 2)
    scale = D ** -0.5
    out = {}
    out["triton_shared_us"] = timed(lambda: decode_attention(q, k, v, bias, L, scale, pre, impl="triton"))
    out["triton_plain_us"] = timed(lambda: decode_attention(q, plain_k, plain_v, bias, L, scale, impl="triton"))
    out["sdpa_plain_us"] = timed(lambda: decode_attention(q, plain_k, plain_v, bias, L, scale, impl="sdpa"))
    a = decode_attention(q, k, v, bias, L, scale, pre, impl="triton").float()
    ref = decode_attention(q, plain_k, plain_v, bias, L, scale, impl="sdpa").float()
    out["max_abs_diff_vs_sdpa"] = (a - ref).abs().max().item()
    per_tok = 2 * kvh * D * 2
    out["floor_shared_us"] = (B * prompt + batch * own) * per_tok / bw * 1e6
    out["floor_plain_us"] = batch * L * per_tok / bw * 1e6
    return dict(model=model, batch=batch, n=n, prompt=prompt, own=own, **out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--own", nargs="+", type=int, default=[64, 256, 512])
    ap.add_argument("--new", type=int, default=512)
    args = ap.parse_args()
    bw = copy_bandwidth()
    rows = []
    for model in args.models:
        for batch in args.batches:
            for own in args.own:
                r = case(model, batch, max(1, min(args.n, batch)), args.prompt, own, args.new, bw)
                rows.append(r)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                copy_bandwidth_GBps=bw / 1e9)
    import triton

    meta["triton"] = triton.__version__
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_attention.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
