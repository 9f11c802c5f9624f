"""bench.bench_lora_tiling: every tiling's output is checked against the torch path before it is
timed, and the report sets the default first with the per-step projection (CPU smoke run in Triton's
interpreter, a subprocess so the interpreter is on before Triton's import)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_lora_tiling import group_shapes, parse_tiling, tiling_text, tilings
from qerl_kit.kernels.lora_triton import DEFAULT_TILING, Tiling

ROOT = Path(__file__).resolve().parents[1]


def test_group_shapes_are_the_fused_groups_of_a_layer():
    s = group_shapes("Qwen2.5-7B")
    assert s == {"qkv": (3584, [3584, 512, 512]), "o": (3584, [3584]), "gate_up": (3584, [18944, 18944]),
                 "down": (18944, [3584])}


def test_the_grid_starts_with_the_default_and_holds_it_once():
    for smoke, size in ((True, "full"), (False, "full"), (False, "small")):
        grid = tilings(smoke, size)
        assert grid[0] == DEFAULT_TILING and grid.count(DEFAULT_TILING) == 1 and len(set(grid)) == len(grid)
        assert all(parse_tiling(tiling_text(t)) == t for t in grid)  # best.txt's form reads back
    assert len(tilings(False, "small")) == 21 and set(tilings(False, "small")) < set(tilings(False, "full"))


def test_the_smoke_run_reports_every_rows_count_with_a_small_error(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.bench_lora_tiling", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "lora_tiling.md").read_text()
    assert "## 1 rows" in md and "## 5 rows" in md and md.count("(Tiling()) |") == 2 and "lora_apply_'s (" in md
    best = parse_tiling((tmp_path / "best.txt").read_text().strip())  # the form device.sh hands on
    assert best in tilings(True) and "Fastest over every row count: " in md
    err = float(re.search(r"largest error against the torch path over every case: ([0-9.e+-]+)", md).group(1))
    assert err < 1e-4  # float32 on the CPU: the same sums, cut into other chunks


def test_a_tiling_is_read_from_its_command_line_form_and_a_malformed_one_is_refused():
    assert parse_tiling("8,64,4") == Tiling(max_splits=8, block_m=64, n_blocks=4)
    assert parse_tiling("32,16,1,reduce") == Tiling(reduce=True)
    for bad in ("8,64", "8,64,4,fast", "a,64,4", "8,64,4,reduce,x"):
        with pytest.raises(ValueError, match="SPLITS,BLOCK_M,N_BLOCKS"):
            parse_tiling(bad)
    with pytest.raises(ValueError, match="Tiling.block_m must be 16, 32 or 64; got 8"):
        parse_tiling("8,8,4")
