"""bench/bench_trl_step.py (the field's GRPO step: TRL's GRPOTrainer, QLoRA and Unsloth) on the CPU: the
trl-bf16 stack really trains the shipped tiny model in its own process (exact completion lengths, LoRA
weights moved by the optimizer, timed steps with the warm-up marked, settings and versions in every row,
step.md), the argument errors, failed / skipped / killed stacks kept as rows, the table's means, and the
exact-length prompts. The NF4 and Unsloth stacks need CUDA (bitsandbytes, vLLM): their tests skip here
and run in ``bench/device.sh gpu-tests tests/test_bench_trl_step.py``."""

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bench_trl_step, trl_report
from bench.random_checkpoint import exact_prompts, word, write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
NO_TRL = importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None
needs_trl = pytest.mark.skipif(NO_TRL, reason="trl and datasets are not installed (the dev extra pins them)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPE = ["--model", "tiny", "--prompts", "2", "--group", "2", "--new", "6", "--prompt-len", "12",
         "--micro-batch", "2", "--lora-r", "4"]


def _cli(out, *args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "bench.bench_trl_step", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(ln) for ln in (out / "rows.jsonl").read_text().splitlines()]


def _check_trained(rows, new, steps, mu, rows_per_step):
    """What every ok stack's rows must show: one row per step, the first the warm-up, exact lengths in the
    generation call and in TRL's own log, LoRA weights moved, the phases adding up."""
    assert [r["status"] for r in rows] == ["ok"] * steps, [r.get("error") for r in rows]
    assert [r["step_index"] for r in rows] == list(range(1, steps + 1))
    assert [r["warmup"] for r in rows] == [True] + [False] * (steps - 1)
    for r in rows:
        assert r["completions"] == rows_per_step
        assert r["completion_len_min"] == r["completion_len_max"] == new and r["lengths_ok"] is True
        assert r["trl_len_min"] == r["trl_len_max"] == new  # TRL's logged completions/min_length, max_length
        assert r["optimizer_steps"] == steps * mu  # one rollout, mu optimizer steps, per measured step
        assert r["lora_max_change"] > 0 and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        # the generation call is seen on TRL's own paths; a stack that bypasses it has its lengths from TRL's log
        assert r["lengths_source"] == "generation call" or r["stack"] == "unsloth"
        if r["lengths_source"] == "generation call":
            assert 0 < r["generate_s"] <= r["rollout_s"]
        assert 0 < r["rollout_s"] < r["step_s"]
        assert math.isclose(r["update_s"], r["step_s"] - r["rollout_s"])
        assert math.isclose(r["tokens_per_s"], rows_per_step * new / r["step_s"])


@needs_trl
def test_trl_bf16_trains_the_tiny_model_with_exact_lengths_and_timed_steps(tmp_path):
    seed = random.randrange(1000)
    rows = _cli(tmp_path, *SHAPE, "--stacks", "trl-bf16", "--steps", "2", "--mu", "2", "--seed", str(seed))
    _check_trained(rows, new=6, steps=2, mu=2, rows_per_step=4)
    r = rows[0]
    for key, want in dict(stack="trl-bf16", model="tiny", prompts=2, group=2, rows=4, new=6, prompt_len=12,
                          micro_batch=2, mu=2, lora_r=4, loss="grpo", lr=1e-5, gradient_checkpointing=True, steps=2,
                          seed=seed, trl_vllm="off", gpu="cpu").items():
        assert r[key] == want, key
    from importlib.metadata import version

    assert r["trl"] == version("trl") and r["transformers"] == version("transformers") and r["date"]
    assert r["model_class"] == "PeftModelForCausalLM" and r["lora_tensors"] == 4 * 7 * 2  # 4 layers x 7 x (A, B)
    # TRL kept every argument asked for; mu 2 with 2 micro-batches per rollout: TRL's own old-log-prob pass
    assert r["trainer_class"] == "GRPOTrainer" and r["args_changed"] == [] and r["old_logp_pass"] is True
    assert r["effective_args"]["gradient_accumulation_steps"] == 2 and r["effective_args"]["optim"] == "adamw_torch"
    md = (tmp_path / "step.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("| trl-bf16 |"))
    assert "6-6 (all exact) | yes | none | ok |" in line
    # the table's step s is the mean of the steps after the warm-up (here the one second step)
    assert f"| {rows[1]['step_s']:.2f} |" in line and f"| {rows[0]['step_s']:.2f} |" in line
    assert "--lengths fixed:6 --prompts 2 --group 2 --prompt-len 12 --micro-batch 2 --mu 2" in md
    assert (tmp_path / "trl-bf16_log.txt").exists()


@needs_trl
def test_a_stack_that_fails_or_is_killed_or_skipped_is_a_row(tmp_path):
    rows = _cli(tmp_path / "a", *SHAPE, "--stacks", "trl-bf16", "--limit", "0.5")  # killed after 1 s, at import
    assert [r["status"] for r in rows] == ["crashed"] and "timeout" in rows[0]["error"]
    rows = _cli(tmp_path / "b", *SHAPE, "--stacks", "trl-nf4", "unsloth", "--budget", "0")
    assert [(r["stack"], r["status"]) for r in rows] == [("trl-nf4", "skipped"), ("unsloth", "skipped")]
    assert "--budget" in rows[0]["error"] and rows[0]["new"] == 6
    md = (tmp_path / "b" / "step.md").read_text()
    assert "| trl-nf4 |" in md and "skipped: the call's --budget" in md


def test_a_kept_random_checkpoint_is_reused_by_the_next_call(tmp_path):
    keep = tmp_path / "keep"
    argv = ["--model", "qwen2-tiny", "--stacks", "trl-bf16", "--budget", "0", "--isolate", "off",
            "--keep-checkpoint", str(keep)]
    assert bench_trl_step.main([*argv, "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "rows.jsonl").read_text().splitlines()[0])
    ckpt = keep / "random-qwen2-tiny"
    assert first["model_source"] == "random bf16 weights of the preset's shape" and first["vocab"] == 512
    assert (ckpt / "config.json").exists() and (ckpt / "tokenizer.json").exists()
    stamp = (ckpt / "model.safetensors").stat().st_mtime_ns
    assert bench_trl_step.main([*argv, "--out", str(tmp_path / "b")]) == 0
    second = json.loads((tmp_path / "b" / "rows.jsonl").read_text().splitlines()[0])
    assert second["model_source"].endswith("(reused)") and (ckpt / "model.safetensors").stat().st_mtime_ns == stamp
    (ckpt / "bench_checkpoint.json").unlink()  # an unfinished write: written again
    assert bench_trl_step.main([*argv, "--out", str(tmp_path / "c")]) == 0
    assert (ckpt / "bench_checkpoint.json").exists() and (ckpt / "model.safetensors").stat().st_mtime_ns != stamp


def _refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        a = bench_trl_step.parser().parse_args(["--out", "x", *argv])
        bench_trl_step.check_args(a)
    return str(e.value.code) + capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--stacks", "trl-nf5"], ["stack 'trl-nf5'", "allowed trl-nf4, trl-bf16, unsloth"]),
    (["--mu", "0"], ["--mu 0", ">= 1"]),
    (["--prompts", "3", "--group", "2", "--micro-batch", "4"], ["--micro-batch 4", "prompts x group = 6"]),
    (["--group", "1"], ["--group 1", ">= 2 completions"]),
    (["--trl-vllm", "server"], ["trl-vllm 'server'", "allowed off, colocate"]),
    (["--gradient-checkpointing", "yes"], ["'yes'", "allowed on, off"]),
    (["--stacks", "unsloth", "unsloth"], ["named twice"]),
    (["--model", "Qwen9-1B"], ["--model 'Qwen9-1B'", "tiny, a model directory", "Qwen2.5-7B"]),
    (["--vllm-memory", "1.5"], ["--vllm-memory 1.5", "(0, 1)"]),
    (["--new", "0"], ["--new 0", ">= 1"]),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, words, capsys):
    msg = _refused(argv, capsys)
    assert all(w in msg for w in words), msg


def test_the_table_reports_the_mean_after_the_warm_up_and_each_failure():
    rng = random.Random()
    times = [rng.uniform(1, 9) for _ in range(4)]
    base = dict(date="d", gpu="g", model="m", prompts=2, group=2, rows=4, new=5, prompt_len=8, micro_batch=2, mu=1,
                lora_r=4, gradient_checkpointing=False, trl_vllm="colocate")
    ok = [dict(base, stack="trl-bf16", status="ok", step_index=i + 1, warmup=i == 0, step_s=t, rollout_s=t / 2,
               generate_s=t / 3, update_s=t / 2, tokens_per_s=20 / t, peak_gib=1.0, completion_len_min=5,
               completion_len_max=5, lengths_ok=True) for i, t in enumerate(times)]
    bad = dict(base, stack="unsloth", status="oom", error="OutOfMemoryError: CUDA out of memory | tried")
    md = trl_report.markdown(ok + [bad])
    line = next(ln for ln in md.splitlines() if ln.startswith("| trl-bf16 |"))
    assert f"| {sum(times[1:]) / 3:.2f} |" in line and f"| {times[0]:.2f} |" in line  # mean of 2..4, warm-up apart
    assert "vLLM (TRL colocate, weights pushed)" in line and "5-5 (all exact)" in line
    assert "oom: OutOfMemoryError: CUDA out of memory / tried" in md  # the cell keeps the table's columns
    assert "| – | – | oom:" in md  # a failed stack has no log-prob pass or argument figures to show
    short = dict(ok[1], completion_len_min=3, lengths_ok=False)
    assert "3-5 (NOT exact)" in trl_report.markdown([ok[0], short])


@pytest.mark.parametrize("n", [259, 300, 302])  # the fewest words, and sizes whose self-check once failed
def test_the_word_tokenizer_round_trips_at_small_sizes(tmp_path, n):
    from transformers import AutoTokenizer

    write_word_tokenizer(tmp_path, n, 64)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == n and tok(" " + word(n - 3 - 256))["input_ids"] == [n - 3]


def test_prompts_encode_to_exactly_the_asked_length(tmp_path):
    from transformers import AutoTokenizer

    from qerl_kit.tiny import TINY_DIR

    n, length, seed = 300 + random.randrange(200), random.randrange(5, 40), random.randrange(1000)
    write_word_tokenizer(tmp_path, n, 512)
    for tok in (AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(TINY_DIR)):
        prompts = exact_prompts(tok, 6, length, seed=seed)
        assert [len(tok(p)["input_ids"]) for p in prompts] == [length] * 6
        assert len(set(prompts)) == 6 and prompts == exact_prompts(tok, 6, length, seed=seed)
    word_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert word_tok(" " + word(7))["input_ids"] == [256 + 7] and len(word_tok) == n


def _gpu_stack(tmp_path, stack, *extra):
    rows = _cli(tmp_path, *SHAPE, "--stacks", stack, "--steps", "2", *extra, timeout=600)
    _check_trained(rows, new=6, steps=2, mu=1, rows_per_step=4)
    assert all(r["peak_gib"] > 0 for r in rows)
    return rows


@needs_cuda
@pytest.mark.skipif(NO_TRL or importlib.util.find_spec("bitsandbytes") is None, reason="needs trl and bitsandbytes")
def test_gpu_trl_nf4_qlora_trains_with_exact_lengths(tmp_path):
    rows = _gpu_stack(tmp_path, "trl-nf4")
    assert rows[0]["bitsandbytes"] != "not installed" and rows[0]["args_changed"] == []


@needs_cuda
@pytest.mark.skipif(NO_TRL or importlib.util.find_spec("vllm") is None, reason="needs trl and vLLM")
def test_gpu_trl_bf16_with_vllm_colocate_trains_with_exact_lengths(tmp_path):
    _gpu_stack(tmp_path, "trl-bf16", "--trl-vllm", "colocate", "--vllm-memory", "0.2")


@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None or importlib.util.find_spec("vllm") is None,
                    reason="needs unsloth and vLLM (bench/make_unsloth_carry.sh)")
def test_gpu_unsloth_grpo_trains_with_exact_lengths(tmp_path):
    rows = _gpu_stack(tmp_path, "unsloth", "--vllm-memory", "0.2")
    assert rows[0]["unsloth"] != "not installed" and "Unsloth" in rows[0]["trainer_class"]  # the patched trainer
    print("unsloth rewrote:", rows[0]["args_changed"], rows[0]["effective_args"])  # recorded, not refused
