"""bench/bench_memory.py: its CPU smoke run writes the table, and a GPU row it appends is a case the
memory plan's test reads (tests/test_memory_plan.py::test_plan_bounds_every_measured_peak)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEAKS = ROOT / "tests" / "data" / "measured_peaks.json"


def test_smoke_run_writes_its_table_and_appends_nothing_on_the_cpu(tmp_path):
    peaks = tmp_path / "peaks.json"
    shutil.copy(PEAKS, peaks)
    proc = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--smoke", "--out", str(tmp_path / "out"),
                           "--append", str(peaks)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "out" / "memory.md").read_text()
    assert "| tiny | nvfp4 | 4 | 8 + 4 | 2 | False | True |" in md and "not measured (CPU)" in md  # the engine's copy
    rows = json.loads((tmp_path / "out" / "memory.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["plan_gib"] > 0 and "error" not in rows[0]
    assert rows[0]["engine_class"] == "StaticEngine"  # the engine the plan's settings describe
    # model.dense_cache_gib was set (--dense-cache all); what the steps held is the plan's dense_cache_bytes
    assert rows[0]["dense_cache_gib"] > 0 and 0 <= rows[0]["settings"]["dense_cache_bytes"] <= rows[0]["dense_cache_gib"] * 2**30
    assert json.loads(peaks.read_text()) == json.loads(PEAKS.read_text())  # no GPU peak: nothing appended
    assert "appended 0 measured cases" in proc.stdout


def test_appended_gpu_row_is_a_case_the_plan_test_reads(tmp_path):
    from bench.bench_memory import append
    from qerl_kit.memory_plan import plan_memory

    peaks = tmp_path / "peaks.json"
    shutil.copy(PEAKS, peaks)
    shape = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True, "model_type": "qwen2"}
    settings = dict(fmt="nvfp4", lora_r=32, optimizer="adamw", rollout_batch=64, group_size=8, prompt_len=256,
                    max_new_tokens=512, micro_batch=8, gradient_checkpointing=False, engine="static",
                    keep_cache=True, humming=True)
    row = dict(model="0.5B", shape=shape, settings=settings, measured_gib=12.3, plan_gib=15.0, ratio=1.2, largest=[])
    skipped = dict(row, measured_gib=math.nan)
    meta = dict(date="2026-12-05", device="NVIDIA H200", torch="2.11.0", args={"steps": 2})
    assert append(peaks, [row, skipped, dict(model="7B", settings={}, error="OOM")], meta, "OUT/memory.json") == 1
    cases = json.loads(peaks.read_text())["cases"]
    new = cases[-1]
    assert len(cases) == len(json.loads(PEAKS.read_text())["cases"]) + 1
    assert new["model"] == shape and new["settings"] == settings and new["measured_gib"] == 12.3
    assert plan_memory(new["model"], **new["settings"]).allocated > 0  # the test's call works on it


def test_each_case_runs_in_its_own_process_and_none_starts_after_the_budget(tmp_path):
    # --isolate on (the GPU's default): the case's row comes back from its own process, written at once,
    # with the settings the child got (--share-weights on: the engine shared, the plan without its copy)
    proc = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--smoke", "--isolate", "on", "--out",
                           str(tmp_path / "iso"), "--share-weights", "on"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "iso" / "memory.json").read_text())["rows"]
    assert len(rows) == 1 and "error" not in rows[0] and rows[0]["plan_gib"] > 0
    assert rows[0]["settings"]["share_weights"] is True
    assert "| True (shared) |" in (tmp_path / "iso" / "memory.md").read_text()
    assert (tmp_path / "iso" / "case_tiny_nvfp4_log.txt").exists()  # the child's own log
    # a spent budget: the case is a row saying so, and the table is still written
    proc = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--smoke", "--budget", "-1", "--out",
                           str(tmp_path / "late")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "late" / "memory.json").read_text())["rows"]
    assert rows[0]["error"].startswith("skipped: --budget") and "failed: skipped" in (tmp_path / "late" / "memory.md").read_text()


@pytest.mark.parametrize("argv", [["--append", "/nonexistent/peaks.json"]])
def test_a_missing_peaks_file_is_refused_before_any_run(argv, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--smoke", "--out", str(tmp_path), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no such file" in proc.stderr
