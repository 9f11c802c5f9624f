"""Where two processes' sampled time differs, frame by frame: two ``py-spy record --format raw`` files.

A host-bound pass (the 0.5B update on a GPU) spends its time in Python and in the launches under it,
which torch.profiler's own overhead distorts and does not attribute to Python frames. A sampling
profiler with native frames (``py-spy record --native``) sees both at its own, smaller cost. Run one
process per format on the same work (``bench/device.sh pyspy-update``: ``bench_dense_cache --modes
dense``, the trainer's pass alone), then

    python -m bench.pyspy_diff none.txt nvfp4.txt --labels none nvfp4 --rate 50 --out diff.md

keeps the samples whose stack passes through ``--within`` (default ``timed_pass``: bench_dense_cache's
timed passes, not the model's build or the warm-up pass's compilation), and lists the frames whose
inclusive seconds (samples / rate, every sample whose stack holds the frame) differ most between the
two, with each one's own seconds (samples where it is the leaf). Frames are named ``function (file)``
without the line, so one function's call sites add up.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# a frame's line number, ":123)" at its end, and an unnamed native frame's address, "0x7f..." at its start
# (bounded patterns: linear in the frame's length)
_LINE = re.compile(r":\d{1,9}\)$")
_ADDRESS = re.compile(r"^0x[0-9a-f]{1,16} ")


def frame_name(frame: str) -> str:
    """``function (file:line)`` -> ``function (file)``; a native frame without a symbol, ``0x7f12... (library)``
    -> ``? (library)`` (its address moves from process to process); ``symbol (library)`` unchanged."""
    return _ADDRESS.sub("? ", _LINE.sub(")", frame.strip()))


def read_raw(text: str, within: str | None = "timed_pass") -> collections.Counter:
    """Samples per stack (a tuple of frame names, outermost first) of py-spy's raw format ("f1;f2;... N" per
    line); with ``within``, only stacks through a frame of that function name."""
    stacks: collections.Counter = collections.Counter()
    for line in text.splitlines():
        head, _, count = line.rstrip().rpartition(" ")
        if not head or not count.isdigit():
            continue
        frames = tuple(frame_name(f) for f in head.split(";"))
        if within is None or any(f.split(" (", 1)[0] == within for f in frames):
            stacks[frames] += int(count)
    return stacks


def frame_samples(stacks: collections.Counter) -> tuple[collections.Counter, collections.Counter]:
    """(inclusive, own) samples per frame name: inclusive counts a sample once for each distinct frame in
    its stack (recursion counted once), own for its leaf frame."""
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for frames, n in stacks.items():
        for f in set(frames):
            inclusive[f] += n
        if frames:
            own[frames[-1]] += n
    return inclusive, own


def diff_markdown(a: collections.Counter, b: collections.Counter, labels: tuple[str, str], rate: float,
                  top: int = 40) -> list[str]:
    """The two runs' sampled seconds and the ``top`` frames by the largest difference in inclusive seconds."""
    if rate <= 0:
        raise ValueError(f"rate must be the sampling rate in samples per second (> 0); got {rate}")
    (ia, oa), (ib, ob) = frame_samples(a), frame_samples(b)
    la, lb = labels
    total_a, total_b = sum(a.values()) / rate, sum(b.values()) / rate
    lines = [f"Sampled seconds: {la} {total_a:.2f}, {lb} {total_b:.2f} ({lb} - {la}: {total_b - total_a:+.2f} s)", "",
             f"| frame | {la} s (inclusive) | {lb} s (inclusive) | {lb} - {la} s | {la} own s | {lb} own s |",
             "|---|---:|---:|---:|---:|---:|"]
    names = sorted(set(ia) | set(ib), key=lambda f: (-abs(ib[f] - ia[f]), f))
    for f in names[:top]:
        cell = f.replace("|", "\\|")
        lines.append(f"| `{cell[:110]}` | {ia[f] / rate:.3f} | {ib[f] / rate:.3f} | {(ib[f] - ia[f]) / rate:+.3f} | "
                     f"{oa[f] / rate:.3f} | {ob[f] / rate:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="py-spy raw file of the first run (the baseline)")
    ap.add_argument("b", help="py-spy raw file of the second run")
    ap.add_argument("--labels", nargs=2, default=["a", "b"])
    ap.add_argument("--rate", type=float, default=50.0,
                    help="py-spy's --rate (samples per second; device.sh pyspy-update records at 50)")
    ap.add_argument("--within", default="timed_pass", help="keep stacks through this function ('' keeps all)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rate <= 0:
        ap.error(f"--rate must be > 0 (py-spy's samples per second); got {args.rate}")
    within = args.within or None
    stacks = [read_raw(Path(p).read_text(errors="replace"), within) for p in (args.a, args.b)]
    for path, s in zip((args.a, args.b), stacks):
        if not s:
            through = f" passes through {within!r}" if within else ""
            ap.error(f"{path}: no sample{through} (is it py-spy's raw format?)")
    command = f"`python -m bench.pyspy_diff {args.a} {args.b} --labels {' '.join(args.labels)} --rate {args.rate:g}`"
    lines = [f"# py-spy: {args.labels[1]} against {args.labels[0]}", "",
             command + (f" (stacks through `{within}`)" if within else " (every stack)"), ""]
    lines += diff_markdown(*stacks, tuple(args.labels), args.rate, args.top)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
