"""Execute notebooks top to bottom with their default parameters and save them with their outputs
and their widget state (so GitHub and a reopened notebook show the panels, not ``VBox(...)`` text).

    python scripts/execute_notebooks.py notebooks/03_aqn_exploration.ipynb --out /tmp/nb   # a copy
    python scripts/execute_notebooks.py notebooks/0*.ipynb --in-place                     # the committed copies

Writes into ``--out`` by default; ``--in-place`` (asked for explicitly) replaces the given notebooks,
each only after its execution succeeded. One torch thread per kernel (reproducible floats, no
oversubscription on a small CPU). Prints each notebook's wall time, and the machine it ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path


def execute(path: Path, timeout: int) -> tuple[object, float]:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(path.parent)}})
    t = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - t
    for key in ("papermill",):
        nb.metadata.pop(key, None)
    return nb, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, help="directory for the executed copies (default: a temporary one)")
    ap.add_argument("--in-place", action="store_true", help="replace the given notebooks with their executed copies")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = ap.parse_args(argv)
    if args.in_place and args.out:
        ap.error("--in-place and --out exclude each other")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = args.out
    if not args.in_place and out is None:
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="notebooks-"))
    import nbformat

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, load {os.getloadavg()[0]:.1f}")
    for path in args.notebooks:
        nb, seconds = execute(path.resolve(), args.timeout)
        dst = path if args.in_place else out / path.name
        if not args.in_place:
            dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".tmp")
        nbformat.write(nb, tmp)
        os.replace(tmp, dst)
        print(f"{path.name}: {seconds:.0f} s -> {dst}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
