"""bench/bench_rollout.py's CPU smoke run, --skip-done, report_rollout.py merging runs, and
bench/bench_lora_engine.py's CPU smoke run."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# one intra-op thread in the bench processes, as tests/conftest.py gives this one: the tiny models
# gain nothing from more, and on a busy 2-core machine extra threads only fight other processes
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _bench(out, *extra):
    proc = subprocess.run([sys.executable, "-m", "bench.bench_rollout", "--smoke", "--parts", "rollout",
                           "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _cases(path):
    with open(path, newline="") as f:
        return {(r["model"], r["variant"], int(r["batch"])) for r in csv.DictReader(f)}


@pytest.mark.slow
def test_skip_done_runs_only_missing_cases_and_reports_merge(tmp_path):
    _bench(tmp_path / "a")
    first = _cases(tmp_path / "a" / "rollout.csv")
    assert ("qwen2-tiny", "engine-nvfp4", 4) in first and ("llama-tiny", "engine-nvfp4", 1) in first
    partial = tmp_path / "partial.csv"
    rows = list(csv.DictReader(open(tmp_path / "a" / "rollout.csv", newline="")))
    with open(partial, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(r for r in rows if (r["model"], r["variant"], r["batch"]) != ("qwen2-tiny", "engine-nvfp4", "4"))
    _bench(tmp_path / "b", "--skip-done", str(partial))
    assert _cases(tmp_path / "b" / "rollout.csv") == {("qwen2-tiny", "engine-nvfp4", 4)}

    report = subprocess.run([sys.executable, "-m", "bench.report_rollout", str(tmp_path / "a"),
                             str(tmp_path / "b"), "--write", str(tmp_path / "merged")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "(run 1:" in report.stdout and "(run 2:" in report.stdout and "### qwen2-tiny" in report.stdout
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert len(merged["meta"]["runs"]) == 2 and _cases(tmp_path / "merged" / "rollout.csv") == first
    b_row = json.loads((tmp_path / "b" / "results.json").read_text())["rollout"][0]
    again = [r for r in merged["rollout"] if (r["model"], r["variant"], r["batch"]) == ("qwen2-tiny", "engine-nvfp4", 4)]
    assert again == [b_row]  # the later run's row wins


def test_lora_engine_bench_smoke_writes_its_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.bench_lora_engine", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in (tmp_path / "lora_engine_h200.md").read_text().splitlines()
            if line.startswith(("| nvfp4 |", "| bf16 |"))]
    assert len(rows) == 4                                        # two weight formats x batches 1, 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[2:5])            # torch ops, grouped kernels, no LoRA work


def test_vllm_bench_bf16_export_holds_the_base_under_its_own_names(tmp_path):
    # vLLM 0.26 refused the first bf16 export: it kept peft's `base_layer` level in the names
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from bench.bench_rollout import build, with_lora
    from bench.bench_vllm_lengths import export

    peft = with_lora(build("qwen2-tiny", "bf16", "cpu"), 4)
    path = export(peft, "bf16", tmp_path)
    keys = [k for f in path.glob("*.safetensors") for k in safe_open(f, "pt").keys()]
    assert keys and not [k for k in keys if "base_layer" in k or "lora_" in k]
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    ours = peft.get_base_model().model.layers[0].mlp.down_proj.base_layer.weight
    assert torch.equal(reloaded.model.layers[0].mlp.down_proj.weight, ours)


def test_vllm_bench_dummy_export_writes_the_config_alone(tmp_path):
    # the 32B bf16 run: vLLM's load_format="dummy" needs the config only (61 GiB would not fit)
    import pytest
    from transformers import AutoConfig

    from bench.bench_rollout import build, with_lora
    from bench.bench_vllm_lengths import export

    peft = with_lora(build("qwen2-tiny", "bf16", "cpu"), 4)
    path = export(peft, "bf16", tmp_path, weights=False)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    config = AutoConfig.from_pretrained(path)
    assert (config.hidden_size, config.num_hidden_layers) == (peft.config.hidden_size, peft.config.num_hidden_layers)
    with pytest.raises(ValueError, match="fmt='nvfp4'"):
        export(peft, "nvfp4", tmp_path, weights=False)


def test_grpo_engines_bench_smoke_times_whole_steps(tmp_path):
    # the StaticEngine half on the CPU (vLLM's half needs the GPU: tests/test_vllm_gpu.py covers the engine)
    proc = subprocess.run([sys.executable, "-m", "bench.bench_grpo_engines", "--smoke", "--engines", "static",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "grpo_engines_nvfp4.json").read_text())["rows"]
    assert [(r["engine"], r["step_index"]) for r in rows] == [("static", 1)] and "error" not in rows[0]
    r = rows[0]
    # loss.old_logp "fold" (the default): no pass runs before the update, its log-probs come from the update's
    assert r["time_rollout"] > 0 and r["time_logprob"] == 0.0 and r["time_update"] > 0
    assert r["time_step"] >= r["time_rollout"] + r["time_logprob"] + r["time_update"] - 1e-6


@pytest.mark.slow
def test_nf4_and_mxfp4_engine_variants_decode_on_the_fused_path(tmp_path):
    """engine-nf4 / engine-mxfp4: the StaticEngine's fused step on those formats (the lut4 kernels on a GPU)."""
    _bench(tmp_path, "--variants", "engine-nf4", "engine-mxfp4")
    rows = list(csv.DictReader(open(tmp_path / "rollout.csv", newline="")))
    lut4 = {(r["model"], r["variant"], int(r["batch"])): r["path"] for r in rows if r["variant"] in ("engine-nf4",
                                                                                                   "engine-mxfp4")}
    assert {v for _, v, _ in lut4} == {"engine-nf4", "engine-mxfp4"} and set(lut4.values()) == {"fused"}
