"""The step bench's completion lengths (``bench.bench_step --lengths``): ``fixed:N``, the paper's GSM8K
preset (``paper``, ``paper-tail``), ``lognormal:MEAN:SIGMA:CAP[:TAIL]``, ``measured:NAME`` (resampled
from the lengths a real model wrote, ``bench.measured_lengths``) and ``natural:N`` (not forced), each
drawn for a run's rows with its parameters and a hash of the draw."""

from __future__ import annotations

import random

from bench.bench_live_rows import hash_lengths, lengths_for

PAPER = dict(mean=300.0, sigma=0.8, cap=4096)  # the paper's GSM8K preset: max_new_tokens 4096
# paper-tail: a stress case, 4% of the rows to the cap, as if the completions that hit a 512-token cap
# (the real 0.5B: 2.6-6.1% of GSM8K problems greedily, 4.0-4.7% sampled, bench/results/real_model_h200.md)
# never stopped. Given 4096 tokens they do stop: 0 of 256 reached 1024 (bench/results/lengths_real05b_cpu),
# whose measured lengths ``measured:real05b`` resamples.
PAPER_TAIL = 0.04
LENGTHS_HELP = "fixed:N, paper, paper-tail, lognormal:MEAN:SIGMA:CAP[:TAIL], measured:NAME or natural:N"


def _lognormal(spec: str) -> tuple[float, float, int, float]:
    """(mean, sigma, cap, tail share) of ``paper``, ``paper-tail`` or ``lognormal:MEAN:SIGMA:CAP[:TAIL]``."""
    kind, _, rest = spec.partition(":")
    if kind in ("paper", "paper-tail") and not rest:
        return PAPER["mean"], PAPER["sigma"], PAPER["cap"], PAPER_TAIL if kind == "paper-tail" else 0.0
    values = [float(x) for x in rest.split(":")]
    if kind != "lognormal" or len(values) not in (3, 4):
        raise ValueError
    mean, sigma, cap, tail = (values + [0.0])[:4]
    if mean <= 0 or sigma < 0 or cap < 1 or not 0 <= tail <= 1 or cap != int(cap):
        raise ValueError
    return mean, sigma, int(cap), tail


def _measured(name: str, rows: int, max_new_tokens: int | None, seed: int) -> tuple[list[int], str, int]:
    """``rows`` lengths drawn with replacement (seeded) from the measurement ``name``; a run cap below the
    measurement's scales every length by the same factor, as for the lognormal specs."""
    from bench.measured_lengths import load

    data = load(name)
    pool, cap = data["lengths"], data["max_new_tokens"]
    rng = random.Random(f"measured/{name}/{seed}/{rows}")
    lengths = [rng.choice(pool) for _ in range(rows)]
    if max_new_tokens and max_new_tokens < cap:
        lengths = [max(1, round(x * max_new_tokens / cap)) for x in lengths]
        cap = max_new_tokens
    params = (f"measured {name}: {data.get('model', '?')} T={data.get('temperature', '?')}, {len(pool)} completions, "
              f"resampled seed {seed}, cap {cap}")
    return lengths, params, cap


def draw_lengths(spec: str, rows: int, max_new_tokens: int | None = None, seed: int = 0) -> dict:
    """The completion lengths ``spec`` asks for ``rows`` rows: ``lengths`` (None for ``natural``: not
    forced), ``max_length``, ``mean_length``, ``params`` (what was drawn, after scaling), ``lengths_sha``
    and ``max_new_tokens`` (the run's setting: the cap, as a real run of that preset sets it).
    ``max_new_tokens`` caps a fixed length and scales a distribution's mean and cap. A tail share
    sends that share of the rows (``round(share x rows)``, seeded choice) to the cap: the completions
    that never stop."""
    kind, _, rest = spec.partition(":")
    try:
        if kind in ("fixed", "natural"):
            n = int(rest)
            if n < 1:
                raise ValueError
            n = min(n, max_new_tokens or n)
            if kind == "natural":
                return dict(lengths=None, max_length=n, mean_length=float("nan"), params=f"natural up to {n}",
                            lengths_sha="", max_new_tokens=n)
            lengths, params, top = [n] * rows, f"fixed {n}", n
        elif kind == "measured":
            lengths, params, top = _measured(rest, rows, max_new_tokens, seed)
        else:
            mean, sigma, cap, tail = _lognormal(spec)
            if max_new_tokens and max_new_tokens < cap:
                mean, cap = mean * max_new_tokens / cap, max_new_tokens
            lengths = lengths_for(rows, mean, sigma, cap, seed)
            for i in random.Random(f"tail/{seed}/{rows}").sample(range(rows), round(tail * rows)):
                lengths[i] = cap
            params, top = f"lognormal mean {mean:g} sigma {sigma:g} cap {cap} seed {seed}", cap
            params += f", {tail:g} of the rows to the cap" if tail else ""
    except ValueError as err:
        why = f"; {err}" if kind == "measured" and str(err) else ""  # which measurements there are
        raise ValueError(f"--lengths {spec!r}: expected {LENGTHS_HELP} (N, MEAN, CAP >= 1, SIGMA >= 0, "
                         f"TAIL in [0, 1]){why}") from None
    return dict(lengths=lengths, max_length=max(lengths), mean_length=sum(lengths) / rows, params=params,
                lengths_sha=hash_lengths(lengths), max_new_tokens=top)


