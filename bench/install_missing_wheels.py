"""Install, from a folder of carried wheels, only those whose packages the machine cannot import yet.

    python3 -m bench.install_missing_wheels .whl/nb --target /tmp/nbsite   # then PYTHONPATH=/tmp/nbsite:...

For the H200 machine, where a missing package travels as a wheel (bench/make_notebook_carry.sh).
A wheel whose import names all resolve already is left out, so the carried copy never shadows the
image's own build of the same package (numpy, say, against which its torch was built).
The import names come from the wheel's ``top_level.txt``; failing that, from the top-level
entries of its ``RECORD``. Nothing is fetched: pip runs with ``--no-index --no-deps``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path


def import_names(wheel: Path) -> list[str]:
    """The top-level modules and packages a wheel installs."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if top:
            listed = zf.read(top[0]).decode().split()
            if listed:
                return sorted(set(listed))
        found = set()
        for n in names:
            head = n.split("/", 1)[0]
            if head.endswith((".dist-info", ".data")):
                continue
            mod = head.removesuffix(".py") if "/" not in n else head
            if mod.isidentifier():
                found.add(mod)
            elif "/" not in n and n.endswith(".so"):  # an extension module at the top: name.cpython-312-...so
                found.add(n.split(".", 1)[0])
        return sorted(found)


def missing(wheels: list[Path]) -> list[Path]:
    """The wheels with at least one import name that does not resolve here (or none known)."""
    out = []
    for wheel in wheels:
        names = import_names(wheel)
        if not names or any(importlib.util.find_spec(n) is None for n in names):
            out.append(wheel)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a folder of .whl files")
    ap.add_argument("--target", type=Path, required=True, help="pip's --target (prepend it to PYTHONPATH)")
    ap.add_argument("--dry-run", action="store_true", help="only say which wheels would be installed")
    ap.add_argument("--all", action="store_true", help="install every wheel, also over an importable package "
                    "(when an image's older version breaks a carried package that needs a newer one)")
    args = ap.parse_args(argv)
    wheels = sorted(args.folder.glob("*.whl"))
    if not wheels:
        ap.error(f"folder={str(args.folder)!r} holds no .whl files")
    todo = wheels if args.all else missing(wheels)
    skipped = [w.name for w in wheels if w not in todo]
    print(f"installing {len(todo)} of {len(wheels)} wheels; already importable here: {', '.join(skipped) or 'none'}")
    if todo and not args.dry_run:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(args.target), *map(str, todo)], check=True)
    for w in todo:
        print(f"  {w.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
