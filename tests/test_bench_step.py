"""bench/bench_step.py (the whole GRPO step per phase) on the CPU: the tiny model through the real
Trainer in both length modes and both checkpointing settings, the CSV's columns, the ratios and
checkpointing table, ``report`` over several calls, failed and crashed runs kept as rows, and the
length draws. The GPU tables it makes are bench/device.sh's step* commands."""

import csv
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_step, step_group, step_report

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TINY = ["--models", "qwen2-tiny", "--steps", "1", "--prompts", "2", "--group", "2", "--prompt-len", "8",
        "--lora-r", "4", "--micro-batch", "2"]


def _run(out, *extra, process=False):
    """One ``run`` call: in this process (``--isolate off`` runs the cases here too), or as its own."""
    argv = ["run", *TINY, "--out", str(out), *extra]
    if process:
        proc = subprocess.run([sys.executable, "-m", "bench.bench_step", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env=ENV)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    else:
        assert bench_step.main(argv) == 0
    with open(out / "step.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_step_bench_times_every_phase_in_both_length_modes_and_checkpointing_settings(tmp_path):
    rows = _run(tmp_path, "--formats", "none", "nvfp4", "--engines", "static", "--lengths", "fixed:5", "paper",
                "--max-new-tokens", "64", "--gradient-checkpointing", "off", "on", "--isolate", "off")
    assert list(rows[0])[:len(step_report.COLUMNS)] == step_report.COLUMNS
    assert len(rows) == 8 and {r["status"] for r in rows} == {"ok"}
    got = {(r["format"], r["lengths"], r["gradient_checkpointing"]) for r in rows}
    assert got == {(f, ln, ck) for f in ("none", "nvfp4") for ln in ("fixed:5", "paper") for ck in ("False", "True")}
    for r in rows:
        t = {k: float(r[k]) for k in ("time_step", "time_rollout", "time_logprob", "time_update", "time_other")}
        # loss.old_logp "fold" (the default) and beta 0: nothing runs between the rollout and the update
        assert t["time_rollout"] > 0 and t["time_update"] > 0 and t["time_logprob"] == 0.0
        # each phase is a part of the step, and what no phase covers (rewards, advantages) is the rest: not a
        # bound on its size (a wall-clock share of a tiny model's step flakes on a loaded machine)
        assert all(0 <= t[k] <= t["time_step"] for k in ("time_rollout", "time_logprob", "time_update"))
        rest = t["time_step"] - t["time_rollout"] - t["time_logprob"] - t["time_update"]
        assert t["time_other"] >= -1e-6 and math.isclose(t["time_other"], rest, abs_tol=1e-3)
        assert r["aqn"] == str(r["format"] == "nvfp4")  # --aqn auto: the paper's recipe for NVFP4 only
        assert (float(r["aqn_sigma"]) > 0) == (r["format"] == "nvfp4")  # the timed step is a noisy one
        assert float(r["plan_gib"]) > 0 and r["rows"] == "4" and r["step_index"] == "0"
        # --dense-cache all: every 4-bit projection's dense copy may stay; the plan counts what a step held
        assert r["dense_cache"] == "all" and (float(r["dense_cache_gib"]) > 0) == (r["format"] == "nvfp4")
        assert 0 <= float(r["dense_cache_held_gib"]) <= float(r["dense_cache_gib"]) + 1e-9
        # every row ran to exactly its drawn length: the Trainer's mean completion length is the draw's
        assert math.isclose(float(r["measured_mean_length"]), float(r["mean_length"]))
    paper = [r for r in rows if r["lengths"] == "paper"]
    assert {r["lengths_sha"] for r in paper} == {paper[0]["lengths_sha"]}
    assert paper[0]["length_params"] == "lognormal mean 4.6875 sigma 0.8 cap 64 seed 0"  # 300 and 4096 x 64 / 4096
    assert {r["max_new_tokens"] for r in paper} == {"64"}  # the Trainer's setting: the cap, as the preset's 4096
    md = (tmp_path / "step.md").read_text()
    assert "| qwen2-tiny | paper | on | 1 | 2 | 0 | bf16 + LoRA, ours |" in md
    assert "## Gradient checkpointing's cost" in md and "| qwen2-tiny | NVFP4 + LoRA, static | fixed:5 |" in md
    assert (tmp_path / "step.png").stat().st_size > 1000

    # report over two calls: the later call's row of the same setting wins, the ratios come back
    again = _run(tmp_path / "b", "--formats", "none", "--engines", "static", "--lengths", "fixed:5",
                 "--isolate", "off")
    assert bench_step.main(["report", str(tmp_path), str(tmp_path / "b" / "step.csv"), "--out",
                            str(tmp_path / "merged")]) == 0
    merged = step_report.read_csv(tmp_path / "merged" / "step.csv")
    assert len(merged) == 8
    bf16 = [r for r in merged if (r["format"], r["lengths"], r["gradient_checkpointing"]) == ("none", "fixed:5", False)]
    assert [r["run_id"] for r in bf16] == [again[0]["run_id"]]
    ratio = next(r for r in step_report.ratios(merged) if r["lengths"] == "fixed:5" and not r["gradient_checkpointing"])
    ours = next(r for r in merged if (r["format"], r["lengths"], r["gradient_checkpointing"]) == ("nvfp4", "fixed:5", False))
    assert ratio["same_call"] is False
    assert math.isclose(ratio["step"], bf16[0]["time_step"] / ours["time_step"])
    assert (tmp_path / "merged" / "step.md").exists() and (tmp_path / "merged" / "step.png").exists()


def _row(fmt, engine, step, update, ckpt=False, run="r1", **kw):
    return {"model": "Qwen2.5-7B", "format": fmt, "engine": engine, "lengths": "fixed:512", "lengths_sha": "x", "prompts": 8,
            "group": 8, "prompt_len": 256, "lora_r": 32, "mu": 1, "micro_batch": 8, "gradient_checkpointing": ckpt,
            "seed": 0, "steps": 2, "status": "ok", "run_id": run, "time_step": step, "time_rollout": step - update - 1,
            "time_logprob": 1.0, "time_update": update, "time_other": 0.0, **kw}


def test_ratios_are_baseline_over_ours_per_phase_and_skip_failed_baselines():
    rows = [_row("nvfp4", "static", 8.0, 4.0), _row("none", "static", 10.0, 6.0),
            _row("nvfp4", "vllm", 12.0, 4.0, run="r2"), _row("nf4", "static", 16.0, 8.0, status="oom", error="OOM"),
            _row("nvfp4", "static", 9.0, 5.0, ckpt=True), _row("none", "static", 11.0, 7.0, ckpt=True)]
    got = {(r["baseline"], r["gradient_checkpointing"]): r for r in step_report.ratios(rows)}
    assert set(got) == {("bf16 + LoRA, ours", False), ("NVFP4 step driven by vLLM", False), ("bf16 + LoRA, ours", True)}
    bf16 = got[("bf16 + LoRA, ours", False)]
    assert (bf16["step"], bf16["update"], bf16["rollout"], bf16["target"]) == (10 / 8, 6 / 4, 3 / 3, 1.2)
    assert bf16["same_call"] is True and got[("NVFP4 step driven by vLLM", False)]["same_call"] is False
    assert got[("NVFP4 step driven by vLLM", False)]["step"] == 1.5
    cost = {c["format"]: c for c in step_report.checkpointing_cost(rows)}
    assert cost["nvfp4"]["update_cost"] == 5 / 4 and cost["none"]["step_cost"] == 11 / 10 and "nf4" not in cost
    md = step_report.markdown(rows)
    assert "| 1.25x | 1.00x | 1.00x | 1.50x | ≥ 1.2x met | yes |" in md
    assert "oom: OOM" in md  # the failed run stays in the table with its error


def test_the_paper_length_target_covers_a_real_models_own_lengths():
    assert [step_report._target("lengths", "Qwen2.5-7B", spec) for spec in
            ("fixed:512", "paper", "paper-tail", "measured:real15b", "fixed:64")] == [1.2, 1.5, 1.5, 1.5, None]
    assert step_report._target("lengths", "Qwen2.5-0.5B", "measured:real15b") is None
    assert step_report._target(1.3, "Qwen2.5-7B", "measured:real05b") == 1.3


def test_report_pairs_each_baseline_with_the_subject_of_its_own_call(tmp_path):
    # step-vllm measures NVFP4 on our engine next to vLLM; step7b measures it again next to bf16. Read in
    # name order (step-vllm first), the later call's subject row must not replace the vLLM call's
    vllm_call = [_row("nvfp4", "static", 8.0, 4.0, run="vllm-call"), _row("nvfp4", "vllm", 12.0, 4.0, run="vllm-call")]
    bf16_call = [_row("nvfp4", "static", 10.0, 5.0, run="bf16-call"), _row("none", "static", 15.0, 9.0, run="bf16-call")]
    for name, rows in (("step-vllm-nvfp4", vllm_call), ("step7b", bf16_call)):
        (tmp_path / name).mkdir()
        step_report.write_csv(rows, tmp_path / name / "step.csv")
    merged = step_report.merge([tmp_path / "step-vllm-nvfp4", tmp_path / "step7b"])
    subjects = sorted(r["run_id"] for r in merged if (r["format"], r["engine"]) == ("nvfp4", "static"))
    assert subjects == ["bf16-call", "vllm-call"] and len(merged) == 4
    got = {r["baseline"]: r for r in step_report.ratios(merged)}
    assert got["NVFP4 step driven by vLLM"]["same_call"] is True and got["NVFP4 step driven by vLLM"]["step"] == 12 / 8
    assert got["bf16 + LoRA, ours"]["same_call"] is True and got["bf16 + LoRA, ours"]["step"] == 15 / 10
    # a baseline whose call measured no subject is paired with the last subject read, and says so
    alone = [_row("nf4", "static", 20.0, 10.0, run="nf4-call")]
    (tmp_path / "step7b-nf4").mkdir()
    step_report.write_csv(alone, tmp_path / "step7b-nf4" / "step.csv")
    rs = step_report.ratios(step_report.merge([tmp_path / "step-vllm-nvfp4", tmp_path / "step7b", tmp_path / "step7b-nf4"]))
    nf4 = next(r for r in rs if r["baseline"] == "NF4 + LoRA (QLoRA), ours")
    assert nf4["same_call"] is False and nf4["step"] == 20 / 10
    # a repeated baseline: the later input's row wins
    again = [_row("none", "static", 30.0, 9.0, run="rerun")]
    (tmp_path / "zz").mkdir()
    step_report.write_csv(again, tmp_path / "zz" / "step.csv")
    merged = step_report.merge([tmp_path / "step7b", tmp_path / "zz"])
    assert [r["run_id"] for r in merged if r["format"] == "none"] == ["rerun"]


def test_a_run_that_fails_or_whose_process_dies_is_a_row(tmp_path):
    # vLLM runs in a process of its own (here it fails: no MXFP4 export for vLLM); Unsloth is not run
    rows = _run(tmp_path, "--formats", "mxfp4", "--engines", "vllm", "unsloth", "--lengths", "fixed:4", process=True)
    by = {(r["format"], r["engine"]): r for r in rows}
    assert len(rows) == 2 and (tmp_path / "group0_log.txt").exists()
    assert by[("mxfp4", "vllm")]["status"] == "error" and "no MXFP4 + LoRA export" in by[("mxfp4", "vllm")]["error"]
    assert by[("mxfp4", "unsloth")]["status"] in ("not installed", "not run") and by[("mxfp4", "unsloth")]["error"]
    # bitsandbytes' NF4 (the field's QLoRA layers) without bitsandbytes: an error row naming it
    if importlib.util.find_spec("bitsandbytes") is None:
        bnb = _run(tmp_path / "bnb", "--formats", "bnb-nf4", "--isolate", "off")
        assert bnb[0]["status"] == "error" and "bitsandbytes" in bnb[0]["error"]
    # a group that starts after the call's budget is spent: every case a "skipped" row
    skipped = _run(tmp_path / "s", "--formats", "none", "nvfp4", "--budget", "0", "--isolate", "off")
    assert [r["status"] for r in skipped] == ["skipped", "skipped"] and "--budget" in skipped[0]["error"]
    # a process killed before it wrote a row (here by its time limit): the case is a "crashed" row
    args = bench_step.parser().parse_args(["run", *TINY, "--formats", "none", "--out", str(tmp_path / "c")])
    (tmp_path / "c").mkdir()
    cases = bench_step.plan_cases(args)[0]
    a = bench_step.run_settings(args)
    bench_step.run_isolated(cases, a, {"run_id": "t"}, tmp_path / "c", timeout=0.01)
    crashed = bench_step.read_rows(tmp_path / "c" / "rows.jsonl")
    assert [r["status"] for r in crashed] == ["crashed"]
    assert crashed[0]["error"].startswith("process exit timeout (killed at the call's --limit)")


def test_length_draws_are_the_committed_distribution_and_bad_specs_name_the_choices():
    from bench.bench_live_rows import hash_lengths, lengths_for

    paper = bench_step.draw_lengths("paper", 128)
    assert paper["lengths"] == lengths_for(128, 300.0, 0.8, 4096, 0) and max(paper["lengths"]) <= 4096
    assert paper["lengths_sha"] == hash_lengths(paper["lengths"]) and paper["max_length"] > 1024  # a long tail
    # the live-rows tables' draw (cap 1024) is the same draw, capped
    assert [min(x, 1024) for x in bench_step.draw_lengths("paper", 64)["lengths"]] == lengths_for(64, 300, 0.8, 1024)
    tail = bench_step.draw_lengths("paper-tail", 128)
    assert sum(a != b for a, b in zip(tail["lengths"], paper["lengths"])) == 5  # round(0.04 x 128) rows ...
    assert tail["lengths"].count(4096) == 5 and tail["max_new_tokens"] == 4096  # ... run to the cap
    assert tail["params"].endswith("0.04 of the rows to the cap") and tail["lengths_sha"] != paper["lengths_sha"]
    assert bench_step.draw_lengths("lognormal:50:0.5:200:0.25", 8)["lengths"].count(200) >= 2
    assert bench_step.draw_lengths("fixed:512", 3, max_new_tokens=100)["lengths"] == [100] * 3
    assert bench_step.draw_lengths("natural:256", 4)["lengths"] is None
    assert bench_step.draw_lengths("lognormal:50:0.5:200", 8, seed=1)["lengths"] == lengths_for(8, 50, 0.5, 200, 1)
    for bad in ("fixed:0", "fixed", "paper:3", "uniform:5", "lognormal:1:2", "lognormal:1:2:3:1.5"):
        with pytest.raises(ValueError, match=r"expected fixed:N, paper, paper-tail, lognormal:MEAN:SIGMA:CAP\[:TAIL\]"):
            bench_step.draw_lengths(bad, 4)


def test_checkpointing_off_after_on_is_off_again():
    # the Trainer turns checkpointing on and never off; the bench's next case in the process must
    from bench.common import build, with_lora

    peft = with_lora(build("qwen2-tiny", "none", "cpu"), 4)
    peft.activation_checkpointing_enable()
    assert peft.get_base_model().is_activation_checkpointing
    step_group.set_checkpointing(peft, False)
    assert not peft.get_base_model().is_activation_checkpointing


def test_a_real_model_directory_runs_on_gsm8k_prompts_with_its_own_or_forced_lengths(tmp_path, monkeypatch):
    # the shipped tiny model saved as a model directory stands for bench.real_model convert's output; a few
    # GSM8K-shaped rows stand for the data folder (CI's clone may have no ../shared/data)
    import json

    from qerl_kit.tiny import load_tiny

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                 "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in ((3, 4), (5, 9), (12, 7), (2, 8))]
        (data / f"gsm8k_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("QERL_DATA", str(data))

    model, tok = load_tiny()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    argv = ["run", "--models", str(tmp_path / "m"), "--formats", "nvfp4", "--lengths", "natural:8", "fixed:3",
            "--steps", "1", "--prompts", "2", "--group", "2", "--lora-r", "4", "--micro-batch", "2", "--isolate", "off",
            "--out", str(tmp_path / "out")]
    assert bench_step.main(argv) == 0
    rows = {r["lengths"]: r for r in step_report.read_csv(tmp_path / "out" / "step.csv")}
    assert {r["status"] for r in rows.values()} == {"ok"} and {r["prompt_len"] for r in rows.values()} == {"gsm8k"}
    assert rows["fixed:3"]["measured_mean_length"] == 3.0
    assert 1 <= rows["natural:8"]["measured_mean_length"] <= 8 and rows["natural:8"]["lengths_sha"] == ""
    # what the rollouts were, from the Trainer's own metrics: the table that sets engines side by side
    own = rows["natural:8"]
    assert 0 <= own["rollout_reward"] <= 1 and 0 <= own["rollout_accuracy"] <= 1 and 0 <= own["rollout_at_cap"] <= 1
    assert own["rollout_entropy"] > 0 and 0 < own["rollout_logp_gap"] < 0.1  # the engine samples the trained policy (0.004 here)
    # the paper's GSM8K optimizer: at the tiny-cpu preset's lr 2e-3 a real model's policy collapsed within two
    # steps, so runs at their own lengths timed different policies (step_h200.md, hold 9)
    assert {r["lr"] for r in rows.values()} == {1e-5}
    md = (tmp_path / "out" / "step.md").read_text()
    table = md.split("## What the rollouts were")[1].split("\n## ")[0]
    assert "natural:8" in table and "fixed:3" not in table  # forced lengths say nothing of the engine


def _vllm_missing() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None if importlib.util.find_spec("vllm") is not None else "needs vLLM"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_each_group_runs_in_its_own_process_with_its_peak_and_plan(tmp_path):
    rows = _run(tmp_path, "--formats", "none", "nvfp4", "nf4", "mxfp4", "--lengths", "fixed:16", "paper",
                "--max-new-tokens", "64", "--steps", "2", process=True)
    assert len(rows) == 8 and {r["status"] for r in rows} == {"ok"}, [r["error"] for r in rows]
    assert len(list(tmp_path.glob("group*_log.txt"))) == 4  # --isolate auto: one process per format
    for r in rows:
        assert float(r["peak_gib"]) > 0 and float(r["plan_gib"]) > 0 and r["gpu"] != "cpu"
        assert math.isclose(float(r["measured_mean_length"]), float(r["mean_length"]))
    ratios = step_report.ratios(step_report.read_csv(tmp_path / "step.csv"))
    assert {r["baseline"] for r in ratios} == {"bf16 + LoRA, ours", "NF4 + LoRA (QLoRA), ours", "MXFP4 + LoRA, ours"}


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                    reason="needs a CUDA GPU and bitsandbytes")
def test_on_the_gpu_bitsandbytes_nf4_is_a_qlora_baseline(tmp_path):
    rows = _run(tmp_path, "--formats", "nvfp4", "bnb-nf4", "--lengths", "fixed:16", "--steps", "2", process=True)
    assert {r["status"] for r in rows} == {"ok"}, [r["error"] for r in rows]
    ratios = step_report.ratios(step_report.read_csv(tmp_path / "step.csv"))
    assert [r["baseline"] for r in ratios] == ["bitsandbytes NF4 + LoRA (QLoRA), ours"]


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(_vllm_missing() is not None, reason=_vllm_missing() or "")
def test_on_the_gpu_the_vllm_driven_step_forces_the_same_lengths(tmp_path):
    rows = _run(tmp_path, "--formats", "nvfp4", "--engines", "static", "vllm", "--lengths", "paper",
                "--max-new-tokens", "64", "--steps", "2", "--vllm-memory", "0.2", process=True)
    by = {r["engine"]: r for r in rows}
    assert {r["status"] for r in rows} == {"ok"}, [r["error"] for r in rows]
    assert by["vllm"]["lengths_sha"] == by["static"]["lengths_sha"]
    assert float(by["vllm"]["measured_mean_length"]) == float(by["static"]["measured_mean_length"])
    assert float(by["vllm"]["time_sync"]) > 0 and float(by["vllm"]["engine_start_s"]) > 0
    assert "NVFP4 step driven by vLLM" in (tmp_path / "step.md").read_text()


@pytest.mark.usefixtures("fake_vllm")
def test_the_vllm_driven_step_sends_each_row_at_its_drawn_length_through_the_trainer(tmp_path, monkeypatch):
    # the step bench's vLLM half against the fake vLLM module (the real one: the GPU test above), which
    # reports a GPU: the peak-memory calls answer as one would
    import torch

    from bench.common import timed_steps

    order = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 << 30)
    args = bench_step.parser().parse_args(["run", *TINY, "--formats", "nvfp4", "--engines", "vllm", "--lengths",
                                           "paper", "--max-new-tokens", "32", "--out", str(tmp_path)])
    cases = bench_step.plan_cases(args)[0]
    a = bench_step.run_settings(args)
    peft, tok = step_group.build_policy("qwen2-tiny", "nvfp4", "cpu", 4)
    engine = step_group.vllm_for(peft, tok, "nvfp4", a, cases, tmp_path, None)
    assert engine.llm.kwargs["max_model_len"] == 64 and engine.llm.kwargs["skip_tokenizer_init"] is True
    drawn = bench_step.draw_lengths("paper", 4, 32)
    engine.lengths, engine.ignore_eos = drawn["lengths"], True
    trainer = step_group.trainer_for(peft, tok, step_group.make_task("qwen2-tiny", peft, 8, 4, 0), engine, cases[0],
                                     a, drawn["max_new_tokens"], tmp_path / "run")
    assert (trainer.config.optim.lr, trainer.config.optim.max_grad_norm) == (1e-5, 0.2)  # the paper's, not tiny-cpu's
    step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda: order.append("step") or step())
    m, _, _ = timed_steps(trainer, 2, "fake vllm")
    assert order == ["step", "step"]  # the peak's restart at each step is the Trainer's (tests/test_trainer.py)
    assert m["bench/cuda_mallocs_before_update"] == 0 and "_prepare" not in vars(trainer)  # counted, then unwrapped
    counts = [int(c) for c in m["bench/gc_collections"].split("/")]  # the step's GC: per generation, its seconds
    assert len(counts) == 3 and m["bench/gc_s"] >= m["bench/gc_s_update"] >= 0 and (m["bench/gc_s"] > 0) == any(counts)
    generate = [c for c in engine.llm.calls if c[0] == "generate"][-1]
    assert [p.kwargs["max_tokens"] for p in generate[2]] == drawn["lengths"]
    assert [p.kwargs["min_tokens"] for p in generate[2]] == drawn["lengths"]
    row = step_group.phase_times(m)
    assert row["time_sync"] > 0 and row["aqn_sigma"] > 0  # the adapter and the step's noisy norms went up
    assert math.isclose(row["measured_mean_length"], drawn["mean_length"])


from tests.test_vllm_backend import fake_vllm  # noqa: E402 - the fake vLLM module, as a fixture here

_FIXTURES = (fake_vllm,)


def test_the_plan_bounds_what_ran_and_vllm_rows_have_none():
    # the plan is plan_memory(...).allocated (the bound of max_memory_allocated), with the dense cache
    # the steps held; a vLLM row gets no figure, with a note saying why
    from bench.common import build, with_lora
    from qerl_kit.memory_plan import plan_memory

    peft = with_lora(build("qwen2-tiny", "nvfp4", "cpu"), 4)
    a = dict(lora_r=4, prompts=2, group=2, prompt_len=8, keep_cache=True, max_rows=None, share_weights=False)
    case = dict(format="nvfp4", engine="static", micro_batch=2, gradient_checkpointing=False)
    r = step_group.plan_row(peft, case, a, 16)
    none, note = r["plan_gib"], r["plan_note"]
    held = step_group.plan_row(peft, case, a, 16, held_gib=0.5)["plan_gib"]
    expect = plan_memory(peft.get_base_model().config, fmt="nvfp4", lora_r=4, optimizer="adamw", rollout_batch=4,
                         prompt_len=8, max_new_tokens=16, micro_batch=2, gradient_checkpointing=False, group_size=2,
                         engine="static", keep_cache=True, humming=False, dense_cache_bytes=0)
    assert note == "" and math.isclose(none, expect.allocated / 2**30)
    assert math.isclose(held - none, 0.5, rel_tol=0.2)  # the held dense copies are counted
    r = step_group.plan_row(peft, dict(case, engine="vllm"), a, 16)
    nan, why = r["plan_gib"], r["plan_note"]
    assert math.isnan(nan) and "vllm" in why
    assert step_group.dense_cache_gib(peft, "all") > 0 and step_group.dense_cache_gib(peft, "1.5") == 1.5


def test_decoding_in_turns_is_a_setting_of_the_row_and_the_plan(tmp_path):
    """--max-rows (rollout.max_rows): the engine decodes that many completions at a time, with every
    row still forced to its drawn length; the row and the plan say so; a value that splits a group
    is refused."""
    from bench.common import build, with_lora

    rows = _run(tmp_path / "m", "--formats", "nvfp4", "--lengths", "paper", "--max-new-tokens", "16",
                "--max-rows", "2", "--keep-cache", "off", "--isolate", "off")
    assert rows[0]["status"] == "ok" and rows[0]["max_rows"] == "2" and rows[0]["keep_cache"] == "False"
    assert math.isclose(float(rows[0]["measured_mean_length"]), float(rows[0]["mean_length"]))  # both turns forced
    whole = _run(tmp_path / "w", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "16")
    assert whole[0]["max_rows"] == "4"  # the step.csv's strings
    peft = with_lora(build("qwen2-tiny", "nvfp4", "cpu"), 4)
    case = dict(format="nvfp4", engine="static", micro_batch=2, gradient_checkpointing=False)
    a = dict(lora_r=4, prompts=2, group=2, prompt_len=8, keep_cache=True, share_weights=False)
    turns = step_group.plan_row(peft, case, {**a, "max_rows": 2}, 16)["plan_gib"]
    at_once = step_group.plan_row(peft, case, {**a, "max_rows": None}, 16)["plan_gib"]
    assert turns < at_once
    with pytest.raises(SystemExit, match="--max-rows 3: must be a positive multiple of --group 2"):
        bench_step.main(["run", *TINY, "--max-rows", "3", "--out", str(tmp_path / "x")])


def test_profile_stacks_names_the_steps_read_backs_by_call_site(tmp_path):
    rows = _run(tmp_path / "s", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "4", "--profile", "stacks")
    text = (tmp_path / "s" / f"profile_case{rows[0]['case_id']}.txt").read_text()
    head, first = text.splitlines()[1:3]
    assert "Python frames' own code" in head
    assert " x aten::" in first and "qerl_kit/" in text  # e.g. the Trainer's loss check, by file and line


def test_step_md_states_the_peak_and_plan_and_the_untied_real_model():
    rows = [_row("nvfp4", "static", 8.0, 4.0, model="Qwen2.5-0.5B"), _row("nvfp4", "static", 8.0, 4.0, model="/tmp/m05")]
    md = step_report.markdown(rows)
    assert "over the last step alone" in md and "span every step" in md and "`.allocated`" not in md
    assert "plan_memory(...).allocated" in md and "untied" in md
    assert "untied" not in step_report.markdown(rows[:1])


def test_profile_adds_one_profiled_step_after_the_timed_ones(tmp_path):
    """--profile: each run writes profile_case<N>.txt (the extra step's phases and its top ops) and the
    reported row is still the last timed step (step_index steps - 1)."""
    rows = _run(tmp_path / "p", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8", "--profile")
    assert rows[0]["status"] == "ok" and rows[0]["step_index"] == str(int(rows[0]["steps"]) - 1)
    text = (tmp_path / "p" / f"profile_case{rows[0]['case_id']}.txt").read_text()
    assert "the profiled step (step " in text and "update" in text
    assert "aten::mm" in text and "Self CPU" in text  # the profiler's own table, CPU time on the CPU
    assert "reads back or synchronizations" in text.splitlines()[1] and "Python frames' own code" not in text


def _metrics(step, rollout, update, reward=0.5):
    return {"time/step": step, "time/rollout": rollout, "time/logprob": 0.0, "time/update": update,
            "completions/mean_length": 5.0, "reward": reward}


def test_steady_times_drop_the_warm_up_and_keep_the_median_and_range():
    steps = [_metrics(30.0, 20.0, 9.0, 0.0), _metrics(10.0, 4.0, 5.0, 0.25), _metrics(12.0, 5.0, 6.0, 0.5),
             _metrics(11.0, 4.5, 6.5, 1.0)]
    row = step_group.steady_times(steps)
    assert row["rollout_reward"] == 0.5833333333333334  # what the rollouts were: the mean, warm-up out
    assert (row["time_step"], row["time_rollout"], row["time_update"]) == (11.0, 4.5, 6.0)  # medians, warm-up out
    assert (row["time_step_min"], row["time_step_max"], row["time_update_min"], row["time_update_max"]) == \
        (10.0, 12.0, 5.0, 6.5)
    assert row["timed_steps"] == 3 and row["time_other"] == 1.0  # its own median (1, 1, 0), not a difference of medians
    two = step_group.steady_times(steps[:2])  # two steps: the last one, as before
    assert (two["time_step"], two["time_step_min"], two["time_step_max"], two["timed_steps"]) == (10.0, 10.0, 10.0, 1)


def test_report_gives_each_ratio_its_range_over_the_timed_steps():
    spread = dict(timed_steps=3)
    ours = _row("nvfp4", "static", 8.0, 4.0, time_step_min=7.5, time_step_max=9.0, **spread)
    base = _row("none", "static", 10.0, 6.0, time_step_min=9.0, time_step_max=12.0, **spread)
    r = step_report.ratios([ours, base])[0]
    assert (r["step"], r["step_low"], r["step_high"]) == (10 / 8, 9 / 9.0, 12 / 7.5)
    md = step_report.markdown([ours, base])
    assert "| 8.00 [7.50-9.00] |" in md and "| 1.00-1.60x |" in md
    single = step_report.ratios([_row("nvfp4", "static", 8.0, 4.0), _row("none", "static", 10.0, 6.0)])[0]
    assert single["step_low"] != single["step_low"]  # one timed step: no range (NaN), shown as –
    assert "| yes | – |" in step_report.markdown([_row("nvfp4", "static", 8.0, 4.0), _row("none", "static", 10.0, 6.0)])


def test_report_lists_the_gpu_state_of_each_run_in_run_order():
    rows = [_row("none", "static", 10.0, 6.0, case_id=1, gpu_before="40 C, 1980 MHz, 100 W", gpu_after="70 C, 1755 MHz, 690 W, events 0x4"),
            _row("nvfp4", "static", 8.0, 4.0, case_id=0, gpu_before="35 C, 1980 MHz, 90 W", gpu_after="")]
    md = step_report.markdown(rows)
    table = md[md.index("## The GPU before and after"):].splitlines()
    assert [line.split("|")[2].strip() for line in table[4:6]] == ["0", "1"]  # the order the cases ran
    assert "| 35 C, 1980 MHz, 90 W | – |" in table[4] and "events 0x4" in table[5]
    assert "## The GPU before" not in step_report.markdown([_row("nvfp4", "static", 8.0, 4.0)])  # nothing recorded


def test_gpu_state_is_empty_without_a_gpu(monkeypatch):
    monkeypatch.setattr(step_group.torch.cuda, "is_available", lambda: False)
    assert step_group.gpu_state() == ""


def test_gpu_state_reads_nvidia_smi_and_falls_back_without_clock_events(monkeypatch):
    import types

    calls = []

    def fake_run(cmd, **_):
        calls.append(cmd[1])
        if "clocks_event_reasons" in cmd[1]:  # an older driver: the field is unknown
            return types.SimpleNamespace(returncode=2, stdout="Field not supported\n")
        return types.SimpleNamespace(returncode=0, stdout="63, 1980, 512.34\n")

    monkeypatch.setattr(step_group.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(step_group.subprocess, "run", fake_run)
    assert step_group.gpu_state() == "63 C, 1980 MHz, 512.34 W" and len(calls) == 2
    monkeypatch.setattr(step_group.subprocess, "run",
                        lambda cmd, **_: types.SimpleNamespace(returncode=0, stdout="70, 1755, 690.1, 0x0000000000000004\n"))
    assert step_group.gpu_state() == "70 C, 1755 MHz, 690.1 W, events 0x0000000000000004"


def test_engine_off_turns_staticengine_features_off_for_the_run_and_the_row_records_it(tmp_path, monkeypatch):
    """--engine-off: the StaticEngine is built with those features False, the row, the report's key and the
    label record them (a same-call A/B that takes the engine apart); a name it does not know is refused."""
    built = []
    real = step_group.forced_static
    monkeypatch.setattr(step_group, "forced_static", lambda *a, **kw: built.append(kw) or real(*a, **kw))
    rows = _run(tmp_path / "off", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8",
                "--engine-off", "compact", "shared_prefix")
    assert built[0]["compact"] is False and built[0]["shared_prefix"] is False and "cuda_graphs" not in built[0]
    assert rows[0]["status"] == "ok" and rows[0]["engine_off"] == "compact shared_prefix"
    assert step_report._label(rows[0]).endswith("(without compact shared_prefix)")
    rows = _run(tmp_path / "on", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8")
    assert "compact" not in built[1] and rows[0]["engine_off"] == "" and "without" not in step_report._label(rows[0])
    assert "engine_off" in step_report.KEY  # rows of two settings are not each other's baseline
    older = {k: v for k, v in rows[0].items() if k not in ("engine_off", "lora_forward")}  # a step.csv from before
    assert step_report._key(older) == step_report._key(rows[0])  # still the same setting as a default run
    # before the layout column the training forward was the padded one: such rows are not a default run's baseline
    assert step_report._key({k: v for k, v in rows[0].items() if k != "layout"}) \
        == step_report._key({**rows[0], "layout": "padded"}) != step_report._key(rows[0])
    with pytest.raises(SystemExit):
        bench_step.main(["run", *TINY, "--engine-off", "graphs", "--out", str(tmp_path / "x")])


def test_dense_decode_is_a_setting_the_engine_gets_and_the_row_records(tmp_path, monkeypatch):
    """--dense-decode (the StaticEngine's dense_decode): the engine is built with it, the row and the
    report's key record it (a same-call A/B of the dense copies), and a bad value names the choices."""
    built = []
    real = step_group.forced_static
    monkeypatch.setattr(step_group, "forced_static", lambda *a, **kw: built.append(kw["dense_decode"]) or real(*a, **kw))
    rows = _run(tmp_path / "on", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8",
                "--dense-decode", "on")
    assert built == ["on"] and rows[0]["status"] == "ok" and rows[0]["dense_decode"] == "on"
    rows = _run(tmp_path / "auto", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8")
    assert built == ["on", "auto"] and rows[0]["dense_decode"] == "auto"
    assert "dense_decode" in step_report.KEY  # rows of two settings are not each other's baseline
    off = {**rows[0], "dense_decode": "off"}
    assert step_report._label(off).endswith("(dense decode off)") and "dense decode" not in step_report._label(rows[0])
    with pytest.raises(SystemExit):
        bench_step.main(["run", *TINY, "--dense-decode", "always", "--out", str(tmp_path / "x")])


def test_share_weights_is_a_setting_the_engine_gets_the_plan_counts_and_the_row_records(tmp_path, monkeypatch):
    """--share-weights on: the engine shares the policy's q/k/v and gate/up, the plan drops the engine's
    copy (a lower plan than the same run's with the copy), the row and the report's key record it."""
    engines = []
    real = step_group.forced_static
    monkeypatch.setattr(step_group, "forced_static", lambda *a, **kw: engines.append(real(*a, **kw)) or engines[-1])
    shared = _run(tmp_path / "on", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8",
                  "--share-weights", "on")
    assert engines[-1].shares_weights and shared[0]["status"] == "ok" and shared[0]["share_weights"] == "True"
    copy = _run(tmp_path / "off", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8")
    assert not engines[-1].shares_weights and copy[0]["share_weights"] == "False"
    assert float(shared[0]["plan_gib"]) < float(copy[0]["plan_gib"])
    assert "share_weights" in step_report.KEY
    assert step_report._label(shared[0]).endswith("(shared weights)") and "shared" not in step_report._label(copy[0])
    with pytest.raises(SystemExit):
        bench_step.main(["run", *TINY, "--share-weights", "yes", "--out", str(tmp_path / "x")])


def test_lora_tiling_is_the_decode_steps_kernels_for_the_run_only_and_the_row_records_it(tmp_path, monkeypatch):
    """--lora-tiling S,M,N[,reduce]: while the run's engine decodes, the fused step's grouped LoRA call
    carries that Tiling; after the run it is the kernels' own again; the row and the key record it; a
    malformed tiling is refused naming the form."""
    import qerl_kit.rollout.static.fast as fast
    from qerl_kit.kernels.lora_triton import Tiling

    seen = []
    real = step_group.forced_static
    monkeypatch.setattr(step_group, "forced_static",
                        lambda *a, **kw: seen.append(getattr(fast.lora_apply_, "keywords", {})) or real(*a, **kw))
    original = fast.lora_apply_
    rows = _run(tmp_path / "t", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8",
                "--lora-tiling", "8,64,4,reduce")
    assert seen == [{"tiling": Tiling(max_splits=8, block_m=64, n_blocks=4, reduce=True)}]
    assert fast.lora_apply_ is original and rows[0]["status"] == "ok" and rows[0]["lora_tiling"] == "8,64,4,reduce"
    assert "lora_tiling" in step_report.KEY
    assert step_report._label(rows[0]).endswith("(LoRA tiling 8,64,4,reduce)")
    rows = _run(tmp_path / "d", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8")
    assert seen[-1] == {} and rows[0]["lora_tiling"] == "default" and "tiling" not in step_report._label(rows[0])
    with pytest.raises(SystemExit):
        bench_step.main(["run", *TINY, "--lora-tiling", "8,64", "--out", str(tmp_path / "x")])


def _a_b(tmp_path, monkeypatch, read, flag: str, value: str, bad: str):
    """A switch's same-call A/B: one NVFP4 run with ``flag value`` and one without, ``read()`` noted as
    each run's timed steps start (what the switch replaced while the run trained); ``flag bad`` refused.
    Returns (the notes, the switched run's rows, the default run's rows)."""
    seen, real = [], step_group.timed_steps
    monkeypatch.setattr(step_group, "timed_steps", lambda *a, **kw: seen.append(read()) or real(*a, **kw))
    common = ("--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8")
    rows = _run(tmp_path / "switched", *common, flag, value)
    assert len(seen) == 1
    default = _run(tmp_path / "default", *common)
    with pytest.raises(SystemExit):
        bench_step.main(["run", *TINY, flag, bad, "--out", str(tmp_path / "x")])
    return seen, rows, default


def test_lora_forward_peft_runs_peft_s_own_layer_for_the_run_only_and_the_row_records_it(tmp_path, monkeypatch):
    """--lora-forward peft: the policy's LoRA layers run peft's forward while the run trains (the fused
    layer's baseline), the fused one after it; the row, the key and the label record it."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    from qerl_kit.lora_layer import FusedLoraLinear

    fused = FusedLoraLinear.forward
    seen, rows, default = _a_b(tmp_path, monkeypatch, lambda: FusedLoraLinear.forward, "--lora-forward", "peft",
                               "unfused")
    assert seen[0] == PeftLoraLinear.forward and FusedLoraLinear.forward is fused
    assert rows[0]["status"] == "ok" and rows[0]["lora_forward"] == "peft" and "lora_forward" in step_report.KEY
    assert step_report._label(rows[0]).endswith("(peft's LoRA forward)")
    assert seen[-1] is fused and default[0]["lora_forward"] == "fused" and "peft" not in step_report._label(default[0])


def test_layout_padded_runs_the_masked_training_forward_for_the_run_only_and_the_row_records_it(tmp_path, monkeypatch):
    """--layout padded: the Trainer's log-prob forwards run completion_logprobs(aligned=False) while the run
    trains (the aligned default's baseline), the default after it; the row, the key and the label record it."""
    from qerl_kit import logprobs, old_policy

    plain = logprobs.completion_logprobs
    seen, rows, default = _a_b(tmp_path, monkeypatch, lambda: old_policy.completion_logprobs, "--layout", "padded",
                               "packed")
    assert seen[0].func is plain and seen[0].keywords == {"aligned": False}
    assert old_policy.completion_logprobs is plain and logprobs.completion_logprobs is plain
    assert rows[0]["status"] == "ok" and rows[0]["layout"] == "padded" and "layout" in step_report.KEY
    assert step_report._label(rows[0]).endswith("(padded layout)")
    assert seen[-1] is plain and default[0]["layout"] == "aligned" and "layout" not in step_report._label(default[0])


def test_a_run_that_fails_later_keeps_its_finished_steps_and_memory_figures(tmp_path, monkeypatch):
    """A run out of memory at its second step is an oom row that still says how many steps finished
    (and, on CUDA, their peak); the Trainer's memory figures reach every step's metrics (fake CUDA counters)."""
    import torch

    from bench import common
    from qerl_kit.trainer import Trainer

    real, calls = Trainer.train_step, []

    def second_fails(self):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1022.00 MiB.")
        return real(self)
    monkeypatch.setattr(Trainer, "train_step", second_fails)
    rows = _run(tmp_path / "o", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8", "--steps", "2")
    assert rows[0]["status"] == "oom" and rows[0]["steps_done"] == "1" and "1022.00 MiB" in rows[0]["error"]

    class Fake:  # a Trainer step whose metrics carry its memory figures (CUDA's, read by the Trainer)
        def train_step(self):
            return {"time/step": 1.0, "memory/rollout_peak_gib": 1.0, "memory/after_rollout_gib": 0.5}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 << 30)
    # the allocator's counters, read before and after each step: 2 cudaMalloc calls in the first, 3 and a retry in the second
    reads = iter([(10, 0), (12, 0), (12, 0), (15, 1)])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: dict(zip(("segment.all.allocated", "num_alloc_retries"),
                                                                     next(reads))))
    every = []
    common.timed_steps(Fake(), 2, "fake", every)
    assert [m["memory/rollout_peak_gib"] for m in every] == [1.0, 1.0] and every[-1]["bench/peak_gib"] == 3.0
    assert [(m["bench/cuda_mallocs"], m["bench/alloc_retries"]) for m in every] == [(2, 0), (3, 1)]
    assert "3 cudaMalloc calls, 1 retries" in common.LOG[-1]


def test_the_plan_by_phase_adds_up_and_the_memory_table_sets_runs_against_it(tmp_path):
    """Each static row carries the plan's phases (the allocated bound is static + max(rollout, training
    + kept)); the memory table shows a run's measured phases next to them, and only runs that have them."""
    rows = _run(tmp_path / "p", "--formats", "nvfp4", "--isolate", "off", "--max-new-tokens", "8")
    r = {k: float(rows[0][k]) for k in ("plan_gib", "plan_rollout_gib", "plan_kept_gib", "plan_training_gib")}
    assert r["plan_training_gib"] > 0 and r["plan_kept_gib"] > 0
    assert math.isclose(r["plan_gib"], max(r["plan_rollout_gib"], r["plan_kept_gib"] + r["plan_training_gib"]))
    assert step_report.memory_table(step_report.read_csv(tmp_path / "p" / "step.csv")) == []  # no CUDA marks here
    measured = {**rows[0], "rollout_peak_gib": "9.5", "after_rollout_gib": "60.25", "peak_gib": "75.75",
                "steps_done": "1", "plan_kept_gib": "57.9", "plan_training_gib": "16.4", "plan_gib": "74.3",
                "gradient_checkpointing": True}
    table = step_report.memory_table([measured])
    assert "| 9.50 (" in table[-1] and "| 60.25 (57.90) | 15.50 (16.40) | 75.75 (74.30) | 1 |" in table[-1]


def test_gc_clock_counts_each_generations_collections_and_their_seconds_while_entered():
    import gc

    from bench.common import GCClock

    with GCClock() as clock:
        gc.collect(1)
        gc.collect(2)
        gc.collect(2)
    assert clock.counts == [0, 1, 2] and clock.seconds[0] == 0 and min(clock.seconds[1:]) > 0
    gc.collect(2)  # after the block: the hook is gone
    assert clock.counts == [0, 1, 2] and clock._hook not in gc.callbacks
