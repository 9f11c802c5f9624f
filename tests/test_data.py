"""Tests for qerl_kit.data: JSONL loaders (shared data, malformed rows, HF fallback) and prompts."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from qerl_kit.data import GSM8K_SUFFIX, MATH_SUFFIX, build_messages, build_prompt, load_gsm8k, load_math500
from qerl_kit.rewards import gsm8k_reward, math_reward

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared data dir {DATA} not found")


def _write(tmp_path: Path, lines: list[str], name: str = "rows.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD_GSM = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"})
GOOD_MATH = json.dumps({"problem": "1+1?", "solution": "$\\boxed{2}$", "answer": "2", "level": 1})


# ----------------------------------------------------------------------------- shared data

@needs_data
def test_load_gsm8k_shared_files():
    rows = load_gsm8k(DATA / "gsm8k_test.jsonl")
    assert len(rows) == 1319
    first = rows[0]
    assert first["prompt"] == first["question"] and first["question"].startswith("Janet")
    assert first["answer"] == "18" and first["solution"].endswith("#### 18")
    by_solution = {r["solution"].rsplit("####", 1)[1].strip(): r["answer"] for r in rows}
    assert by_solution["1,450,000"] == "1450000"  # thousands separators removed
    # the loader's answers and solutions score 1 with the reward, as TRL would call it
    assert gsm8k_reward(None, [r["solution"] for r in rows], answer=[r["answer"] for r in rows]) == [1.0] * 1319
    assert len(load_gsm8k(str(DATA / "gsm8k_train.jsonl"))) == 7473
    assert len(load_gsm8k(DATA / "gsm8k_test.jsonl", limit=5)) == 5


@needs_data
def test_load_math500_shared_file():
    rows = load_math500(DATA / "math500_test.jsonl")
    assert len(rows) == 500
    r = rows[0]
    assert set(r) >= {"prompt", "answer", "problem", "solution", "subject", "level", "unique_id"}
    assert r["prompt"] == r["problem"] and r["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math_reward(None, [x["solution"] for x in rows[:50]], answer=[x["answer"] for x in rows[:50]]) == [1.0] * 50


# ----------------------------------------------------------------------------- malformed rows

@pytest.mark.parametrize("bad,msg", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"question": "q"}), "missing field 'answer'"),
    (json.dumps({"answer": "#### 3"}), "missing field 'question'"),
    (json.dumps({"question": "q", "answer": "   "}), "field 'answer' is empty"),
    (json.dumps({"question": "q", "answer": "it is 3"}), "no '#### <answer>'"),
    (json.dumps({"question": "q", "answer": "it is\n#### "}), "empty answer"),
    (json.dumps({"question": "q", "answer": "#### three"}), "not a number"),
    (json.dumps({"question": ["q"], "answer": "#### 3"}), "must be a string"),
])
def test_malformed_gsm8k_row_names_file_and_line(tmp_path, bad, msg):
    p = _write(tmp_path, [GOOD_GSM, "", bad, GOOD_GSM])  # blank line 2 is skipped; bad row is line 3
    with pytest.raises(ValueError, match=msg) as ei:
        load_gsm8k(p)
    assert f"{p}:3:" in str(ei.value)


@pytest.mark.parametrize("bad,msg", [
    (json.dumps({"problem": "p", "solution": "s"}), "missing field 'answer'"),
    (json.dumps({"problem": "p", "answer": ""}), "field 'answer' is empty"),
    (json.dumps({"solution": "s", "answer": "2"}), "missing field 'problem'"),
    ("\"just a string\"", "expected a JSON object"),
])
def test_malformed_math500_row_names_file_and_line(tmp_path, bad, msg):
    p = _write(tmp_path, [GOOD_MATH, bad])
    with pytest.raises(ValueError, match=msg) as ei:
        load_math500(p)
    assert f"{p}:2:" in str(ei.value)


def test_valid_small_files_and_numeric_answers(tmp_path):
    p = _write(tmp_path, [GOOD_GSM, json.dumps({"question": "q", "answer": "x\n#### -1,250.5", "id": 7})])
    rows = load_gsm8k(p)
    assert [r["answer"] for r in rows] == ["2", "-1250.5"]
    assert rows[1]["id"] == 7 and rows[1]["solution"] == "x\n#### -1,250.5"
    m = load_math500(_write(tmp_path, [json.dumps({"problem": "p", "answer": 12})], "m.jsonl"))
    assert m[0]["answer"] == "12" and m[0]["prompt"] == "p"


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_gsm8k(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError):
        load_math500("data/nope.jsonl")


# ----------------------------------------------------------------------------- Hugging Face fallback

def test_split_name_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_gsm8k("test")


def test_split_name_uses_datasets_when_available(monkeypatch):
    calls = []

    def load_dataset(name, *args, split):
        calls.append((name, args, split))
        if name == "openai/gsm8k":
            return [{"question": "q1", "answer": "a\n#### 5"}, {"question": "q2", "answer": "b\n#### 6"}]
        return [{"problem": "p", "solution": "\\boxed{1}", "answer": "1"}, {"problem": "p2", "answer": ""}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows = load_gsm8k("train", limit=1)
    assert [r["answer"] for r in rows] == ["5"] and rows[0]["prompt"] == "q1"
    assert calls[0] == ("openai/gsm8k", ("main",), "train")
    with pytest.raises(ValueError, match=r"HuggingFaceH4/MATH-500\[test\] row 2: field 'answer' is empty"):
        load_math500("test")


# ----------------------------------------------------------------------------- prompts

def _tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = chat_template
    return fast


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_build_prompt_without_chat_template():
    tok = _tokenizer(None)
    assert build_prompt(tok, "What is 2+2?") == f"Question: What is 2+2?{GSM8K_SUFFIX}\nAnswer:"
    assert build_prompt(None, "Q", system_prompt="Be brief.", suffix="") == "Be brief.\n\nQuestion: Q\nAnswer:"


def test_build_prompt_with_chat_template():
    tok = _tokenizer(TEMPLATE)
    got = build_prompt(tok, "What is 2+2?", system_prompt="Be brief.", suffix=MATH_SUFFIX)
    assert got == (f"<|system|>Be brief.\n<|user|>What is 2+2?{MATH_SUFFIX}\n<|assistant|>")
    assert build_prompt(tok, "Q", suffix="") == "<|user|>Q\n<|assistant|>"
    assert build_messages("Q", "S", "!") == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q!"}]
