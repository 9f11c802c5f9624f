#!/usr/bin/env bash
# Downloads into .whl/nb the wheels that executing a notebook on the H200 machine needs (nbclient,
# ipykernel, ipywidgets, matplotlib, seaborn and what they pull in), for its Python 3.12. Run here, from
# the repository root (needs pip and the network). Left out: numpy and pandas, which the image has
# (the cdsweep part ran pandas there), and their own dependencies. On the H200 side,
# bench/install_missing_wheels.py installs only the wheels whose packages the image lacks
# (bench/device.sh nb05). About 40 MB: carry [".whl"] in a call of its own, not with a vLLM piece.
set -euo pipefail
if [ -n "$(ls -A .whl/nb 2>/dev/null)" ]; then echo ".whl/nb is not empty: remove it first" >&2; exit 1; fi
W=$(mktemp -d) && trap 'rm -rf "$W"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$W" nbclient nbformat ipykernel ipywidgets matplotlib seaborn
mkdir -p .whl/nb
for w in "$W"/*.whl; do
  case "$(basename "$w")" in
    numpy-*|pandas-*|python_dateutil-*|tzdata-*|pytz-*|six-*) ;;
    *) mv "$w" .whl/nb/ ;;
  esac
done
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo "note: .whl/ is not in .git/info/exclude" >&2
du -sh .whl/nb && ls .whl/nb | wc -l
