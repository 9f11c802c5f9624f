"""Where the shipped wgmma kernel's warps stall: ncu's per-instruction stall samples, summed.

    python -m lab.ncu_stalls --run 55296 5120 64 [--out DIR]   # on the GPU: ncu around 3 calls
    python -m lab.ncu_stalls --report DIR/sass_55296_5120_64.csv.gz

``--run`` profiles the third of three calls of ``nvfp4_wgmma_cuda`` on a random [N, K] NVFP4
weight and M x rows (ncu's WarpStateStats, SourceCounters, SchedulerStats, SpeedOfLight and
Occupancy sections plus every ``smsp__average_warps_issue_stalled_*`` ratio), then exports the
report's details (text) and its per-SASS-instruction table (gzipped CSV) next to it. ``--report``
prints, from that CSV, the stall samples by reason and, per SASS opcode, instructions executed
per HGMMA and stall samples by reason. Results: lab/results/proto_wgmma_gemm_h200.md
(session 9).
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import os
import subprocess
import sys
from pathlib import Path

NCU = os.environ.get("NCU", "/usr/local/cuda/bin/ncu")


def calls(n: int, k: int, m: int) -> None:
    """Three eager calls of the shipped kernel (ncu profiles the third: compiled and warm)."""
    import torch

    from bench.bench_nvfp4_gemm import random_nvfp4

    from lab.nvfp4_wgmma_cuda import nvfp4_wgmma_cuda

    torch.manual_seed(0)
    w = random_nvfp4(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        nvfp4_wgmma_cuda(x, *w)
    torch.cuda.synchronize()


def run(n: int, k: int, m: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{n}_{k}_{m}"
    rep = out / f"rep_{tag}"
    sections = ["WarpStateStats", "SourceCounters", "SchedulerStats", "SpeedOfLight", "Occupancy", "LaunchStats"]
    cmd = [NCU, "-k", "regex:nvfp4_wgmma", "--launch-skip", "2", "--launch-count", "1", "-f", "-o", str(rep),
           "--metrics", "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"]
    for s in sections:
        cmd += ["--section", s]
    subprocess.run(cmd + [sys.executable, "-m", "lab.ncu_stalls", "--calls", str(n), str(k), str(m)], check=True)
    details = subprocess.run([NCU, "-i", f"{rep}.ncu-rep", "--print-details", "all"], check=True,
                             capture_output=True, text=True).stdout
    (out / f"details_{tag}.txt").write_text(details)
    sass = subprocess.run([NCU, "-i", f"{rep}.ncu-rep", "--page", "source", "--csv", "--print-source", "sass"],
                          check=True, capture_output=True, text=True).stdout
    with gzip.open(out / f"sass_{tag}.csv.gz", "wt") as f:
        f.write(sass)
    print(f"wrote {out}/details_{tag}.txt and sass_{tag}.csv.gz")


def report(path: Path, top: int = 25) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = rows[1]  # rows[0] names the kernel
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total, by_op = collections.Counter(), collections.defaultdict(collections.Counter)
    samples = 0
    for r in rows[2:]:
        if len(r) < len(header):
            continue
        words = r[col["Source"]].split()
        op = (words[1] if words and words[0].startswith("@") else words[0] if words else "?").split(".")[0]
        s = int(r[col["# Samples"]] or 0)
        samples += s
        by_op[op]["samples"] += s
        by_op[op]["executed"] += int(r[col["Instructions Executed"]].replace(",", "") or 0)
        for h in reasons:
            v = int(r[col[h]] or 0)
            total[h] += v
            by_op[op][h] += v
    print(f"{rows[0][1]}: {samples} stall samples")
    for h, v in total.most_common():
        if v:
            print(f"  {h[6:]:18s} {v:7d}  {v / samples:5.1%}")
    hgmma = by_op["HGMMA"]["executed"] or 1
    executed = sum(c["executed"] for c in by_op.values())
    print(f"\n{executed} warp instructions, {executed / hgmma:.1f} per HGMMA\n")
    print(f"{'opcode':10s} {'per HGMMA':>9s} {'samples':>8s}  top reasons")
    for op, c in sorted(by_op.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        why = ", ".join(f"{h[6:]} {v}" for h, v in c.most_common(4) if h.startswith("stall_") and v)
        print(f"{op:10s} {c['executed'] / hgmma:9.2f} {c['samples']:8d}  {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", nargs=3, type=int, metavar=("N", "K", "M"))
    ap.add_argument("--calls", nargs=3, type=int, metavar=("N", "K", "M"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "ncu_out"))
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()
    if args.calls:
        calls(*args.calls)
    elif args.run:
        run(*args.run, Path(args.out))
    elif args.report:
        report(args.report)
    else:
        ap.error("one of --run or --report")


if __name__ == "__main__":
    main()
