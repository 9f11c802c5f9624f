"""Completion lengths a real model wrote, as a committed distribution for the step bench.

    python -m bench.measured_lengths build EVAL.json [EVAL.json ...] --out bench/results/lengths_real05b_cpu

reads ``qerl eval --out`` files (every completion's token count, stop token included, with the run's
settings), and writes ``OUT/lengths.json`` (the lengths per problem, the settings, the accuracy) and
``OUT/lengths.md`` (mean, median, quantiles and the share of completions at or beyond 512 / 1024 /
2048 tokens and at the cap, each with a 95% Wilson interval, since the sample is small).

``bench.bench_step --lengths measured:NAME`` (``bench.step_lengths``) resamples a run's rows from such
a file: ``NAME`` is a key of ``MEASURED`` or a path to a ``lengths.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# committed measurements by name: the real Qwen2.5-Coder-0.5B- and 1.5B-Instruct GGUFs on GSM8K test, T = 1.0,
# cap 4096 (bench/results/lengths_real05b_cpu/README.md)
MEASURED = {"real05b": ROOT / "bench" / "results" / "lengths_real05b_cpu" / "lengths.json",
            "real15b": ROOT / "bench" / "results" / "lengths_real15b_cpu" / "lengths.json"}
THRESHOLDS = (512, 1024, 2048)


def load(name: str) -> dict:
    """The measurement ``name`` (a key of ``MEASURED`` or a path to a ``lengths.json``): its dict, with
    ``lengths`` (every completion, problem by problem) and ``max_new_tokens`` (the cap it ran with)."""
    path = MEASURED.get(name, Path(name))
    if not path.is_file():
        raise ValueError(f"measured:{name}: no such measurement; use one of {', '.join(MEASURED)} or the path "
                         "of a lengths.json (python -m bench.measured_lengths build)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a lengths.json ({err})") from None
    lengths = data.get("lengths") if isinstance(data, dict) else None
    if not lengths or not all(isinstance(x, int) and 1 <= x <= data.get("max_new_tokens", 0) for x in lengths):
        raise ValueError(f"{path}: 'lengths' must be a non-empty list of ints in [1, max_new_tokens]")
    return data


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a share k / n (sound at k = 0, where k / n +- ... is not)."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _quantile(sorted_lengths: list[int], q: float) -> int:
    return sorted_lengths[min(len(sorted_lengths) - 1, int(q * len(sorted_lengths)))]


def build(evals: list[Path], out: Path, max_new_tokens: int | None = None) -> dict:
    """``lengths.json`` and ``lengths.md`` in ``out`` from ``qerl eval --out`` files of one setting.
    ``max_new_tokens``: the cap the runs used, for files that do not record it (``qerl eval`` records
    it in ``meta`` now); given and recorded, they must agree."""
    runs = [json.loads(p.read_text()) for p in evals]
    keys = ("temperature", "samples")
    if len({tuple(r[k] for k in keys) + (r["meta"]["model"],) for r in runs}) != 1:
        raise ValueError("the eval files differ in model, temperature or samples: one setting per measurement")
    caps = {r["meta"].get("max_new_tokens") for r in runs} | ({max_new_tokens} if max_new_tokens else set())
    if None in caps and not max_new_tokens:
        raise ValueError("an eval file does not record its max_new_tokens: give --max-new-tokens")
    caps.discard(None)
    if len(caps) != 1:
        raise ValueError(f"the eval files and --max-new-tokens disagree on the cap: {sorted(caps)}")
    cap = caps.pop()
    per_problem = [p["lengths"] for r in runs for p in r["per_problem"]]
    lengths = [x for row in per_problem for x in row]
    if max(lengths) > cap:
        raise ValueError(f"a completion of {max(lengths)} tokens is longer than the cap {cap}")
    correct = sum(p["pass_rate"] * len(p["lengths"]) for r in runs for p in r["per_problem"])
    data = dict(model=Path(runs[0]["meta"]["model"]).name, dataset=[Path(r["meta"]["dataset"]).name for r in runs],
                format=runs[0]["meta"].get("format"), temperature=runs[0]["temperature"], samples=runs[0]["samples"],
                max_new_tokens=cap, problems=len(per_problem), completions=len(lengths),
                accuracy=correct / len(lengths), date=date.today().isoformat(),
                sources=[p.name for p in evals], per_problem=per_problem, lengths=lengths)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lengths.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "lengths.md").write_text(summary(data))
    return data


def summary(data: dict) -> str:
    """The measurement as a markdown table: what ran, the quantiles and the tail shares."""
    s = sorted(data["lengths"])
    n, cap = len(s), data["max_new_tokens"]
    logs = [math.log(x) for x in s]
    lines = [f"# Completion lengths of {data['model']} ({', '.join(map(str, data['dataset']))})", "",
             f"{data['completions']} completions: {data['problems']} problems x {data['samples']} samples, "
             f"T = {data['temperature']}, max_new_tokens {cap}, format {data['format']}; accuracy "
             f"{data['accuracy']:.3f}; {data['date']}. Lengths in tokens, the stop token included.", "",
             "| mean | median | q90 | q95 | q99 | max | log-mean | log-sd |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
             f"| {statistics.mean(s):.1f} | {statistics.median(s):g} | {_quantile(s, .9)} | {_quantile(s, .95)} | "
             f"{_quantile(s, .99)} | {s[-1]} | {statistics.mean(logs):.3f} | {statistics.pstdev(logs):.3f} |", "",
             "| completions | count | share | 95% interval (Wilson) |", "|---|---:|---:|---|"]
    for label, k in [*((f">= {t} tokens", sum(x >= t for x in s)) for t in THRESHOLDS if t < cap),
                     (f"at the cap ({cap})", sum(x >= cap for x in s))]:
        lo, hi = wilson(k, n)
        lines.append(f"| {label} | {k} | {k / n:.3f} | {lo:.3f} - {hi:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="lengths.json + lengths.md from qerl eval --out files")
    b.add_argument("evals", nargs="+", type=Path)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--max-new-tokens", type=int, default=None, help="the runs' cap, if their files lack it")
    args = ap.parse_args(argv)
    data = build(args.evals, args.out, args.max_new_tokens)
    print(summary(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
