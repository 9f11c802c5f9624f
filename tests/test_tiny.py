"""The shipped tiny model and its task: offline loading, size, NVFP4 conversion, calibration band;
the arithmetic generator's determinism, disjoint splits and agreement with the GSM8K reward."""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qerl_kit.rewards import gsm8k_reward  # noqa: E402
from qerl_kit.tasks.arith import (LEVELS, TEST_PERCENT, careless_solution, make_dataset,  # noqa: E402
                                  make_problem, split_of)
from qerl_kit.evaluate import evaluate_task  # noqa: E402
from qerl_kit.tasks import make_task  # noqa: E402
from qerl_kit.tiny import TINY_DIR, build_tokenizer, load_tiny  # noqa: E402

MAX_DIR_BYTES = 25 * 10**6


# ----------------------------------------------------------------------------- the task

def test_generator_is_deterministic_per_seed():
    a = make_dataset("train", 200, seed=3)
    assert a == make_dataset("train", 200, seed=3)
    assert a != make_dataset("train", 200, seed=4)
    assert make_dataset("test", 50, seed=1) == make_dataset("test", 120, seed=1)[:50]  # prefix-stable
    row, _ = make_problem(random.Random(7), 3)
    assert row == make_problem(random.Random(7), 3)[0]


def test_rows_have_gsm8k_keys_and_balanced_levels():
    rows = make_dataset("test", 200, seed=0)
    assert all(set(r) == {"prompt", "answer", "solution", "level"} for r in rows)
    assert [sum(r["level"] == k for r in rows) for k in LEVELS] == [50] * 4
    for r in rows:
        lines = r["solution"].split("\n")
        assert len(lines) == r["level"] + 1 and lines[-1] == f"#### {r['answer']}"
        assert all(0 < int(line.rsplit("=", 1)[1]) < 100 for line in lines[:-1])
    assert len({r["prompt"] for r in rows}) == len(rows)
    assert {r["level"] for r in make_dataset("train", 30, seed=0, levels=(2, 4))} == {2, 4}


def test_splits_are_disjoint():
    train = make_dataset("train", 5000, seed=0)
    test = make_dataset("test", 1000, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    # disjoint by construction: the skeleton (the arithmetic) decides the split, not the wording
    assert not {r["solution"] for r in train} & {r["solution"] for r in test}
    rng = random.Random(0)
    share = sum(make_problem(rng, 1 + i % 4)[1] == "test" for i in range(4000)) / 4000
    assert abs(share - TEST_PERCENT / 100) < 0.05
    assert split_of(7, [("+", 5), ("-", 3)]) == split_of(7, (("+", 5), ("-", 3)))
    for other_seed in (1, 2):
        assert not {r["prompt"] for r in make_dataset("train", 2000, seed=other_seed)} & {r["prompt"] for r in test}


def test_gold_solutions_score_one_and_wrong_answers_zero():
    rows = make_dataset("test", 400, seed=0) + make_dataset("train", 400, seed=0)
    answers = [r["answer"] for r in rows]
    assert gsm8k_reward(None, [r["solution"] for r in rows], answer=answers) == [1.0] * len(rows)
    off_by_one = [r["solution"].rsplit("####", 1)[0] + f"#### {int(r['answer']) + 1}" for r in rows]
    assert gsm8k_reward(None, off_by_one, answer=answers) == [0.0] * len(rows)
    rng = random.Random(0)
    slipped = [careless_solution(r, rng, 1.0) for r in rows if r["level"] >= 2]
    assert gsm8k_reward(None, slipped, answer=[r["answer"] for r in rows if r["level"] >= 2]) == [0.0] * len(slipped)
    assert careless_solution(rows[0], rng, 1.0) == rows[0]["solution"]  # level 1 never slips
    assert all(careless_solution(r, rng, 0.0) == r["solution"] for r in rows)


def test_make_dataset_rejects_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        make_dataset("validation", 3)
    with pytest.raises(ValueError, match="levels"):
        make_dataset("train", 3, levels=(0, 1))


# ----------------------------------------------------------------------------- the shipped model

def test_asset_directory_is_small_and_safetensors_only():
    files = {p.name: p.stat().st_size for p in TINY_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))]
    assert sum(files.values()) <= MAX_DIR_BYTES


def test_loads_offline_through_auto_classes():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_DIR, local_files_only=True, trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(TINY_DIR, local_files_only=True, trust_remote_code=False)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert cfg.hidden_size % 64 == 0 and cfg.intermediate_size % 64 == 0
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 10e6
    assert cfg.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_tokenizer_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_DIR, local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "Ann has 7 apples."}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|user|>\nAnn has 7 apples.<|end|>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and tok.decode(ids) == text
    for d in "0123456789":
        assert len(tok(d, add_special_tokens=False)["input_ids"]) == 1
    sample = "12+345=357\n#### 357  Let's see: \"####\"? é"
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample
    # the packaged files give the ids the training script used
    fresh = build_tokenizer()
    assert fresh(sample, add_special_tokens=False)["input_ids"] == tok(sample, add_special_tokens=False)["input_ids"]
    assert tok.padding_side == "left"


def test_every_linear_but_lm_head_quantizes():
    from qerl_kit.quantize import quantize_model

    model, _ = load_tiny()
    report = quantize_model(model, fmt="nvfp4")
    assert len(report.layers) == 7 * model.config.num_hidden_layers
    assert report.skipped == ["lm_head"]
    assert report.mean_rel_error < 0.15


def test_quick_greedy_accuracy_after_nvfp4_is_in_band():
    model, tok = load_tiny(quantize="nvfp4")
    task = make_task()  # the arithmetic task: its held-out rows, prompts and reward
    res = evaluate_task(task, model, tok, make_dataset("test", 64, seed=0), temperature=0, batch_size=64)
    assert 0.10 <= res.accuracy <= 0.60, res.by("level")
    assert res.by("level")[1]["accuracy"] >= 0.8  # one-step problems are solved


@pytest.mark.slow
def test_calibration_on_heldout_split():
    """The documented calibration (docs/tiny-model.md): greedy after NVFP4 in 20-50%, 8 samples at T=1
    find a right answer far more often."""
    torch.manual_seed(0)
    model, tok = load_tiny(quantize="nvfp4")
    task = make_task()
    rows = make_dataset("test", 200, seed=0)
    greedy = evaluate_task(task, model, tok, rows, temperature=0, batch_size=100)
    assert 0.20 <= greedy.accuracy <= 0.50
    sampled = evaluate_task(task, model, tok, rows, samples=8, temperature=1.0, top_p=1.0, batch_size=25)
    assert sampled.pass_at_k >= 0.70
    assert sampled.accuracy > greedy.accuracy
