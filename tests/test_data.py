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
    # every row carries the same columns (a row with a column more is refused: test_configs_data.py)
    p = _write(tmp_path, [json.dumps({**json.loads(GOOD_GSM), "id": 6}),
                          json.dumps({"question": "q", "answer": "x\n#### -1,250.5", "id": 7})])
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


# ----------------------------------------------------------------------------- split names: local files, hub on request

def test_split_name_reads_the_data_folder_never_the_hub(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # any hub access would fail loudly
    (tmp_path / "gsm8k_test.jsonl").write_text('{"question": "q1", "answer": "a\\n#### 1,600"}\n'
                                               '{"question": "q2", "answer": "b\\n#### 6"}\n')
    (tmp_path / "math500_test.jsonl").write_text('{"problem": "p", "answer": "\\\\frac{1}{2}"}\n')
    monkeypatch.setenv("QERL_DATA", str(tmp_path))
    rows = load_gsm8k("test", limit=1)
    assert [(r["prompt"], r["answer"]) for r in rows] == [("q1", "1600")]
    assert load_math500("test")[0]["answer"] == "\\frac{1}{2}"
    assert rows[0] and str(tmp_path) in str(__import__("qerl_kit.data", fromlist=["x"]).find_data_file("gsm8k", "test"))


def test_a_missing_split_names_the_folders_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setenv("QERL_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"gsm8k_train\.jsonl.*QERL_DATA") as err:
        load_gsm8k("train")
    assert str(tmp_path.resolve()) in str(err.value) and "source='hub'" in str(err.value)


def test_default_folders_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("QERL_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gsm8k_test.jsonl").write_text('{"question": "q", "answer": "#### 3"}\n')
    assert load_gsm8k("test")[0]["answer"] == "3"


def test_hub_only_when_asked_and_without_datasets_it_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_gsm8k("test", source="hub")
    with pytest.raises(ValueError, match="source must be"):
        load_gsm8k("test", source="web")


def test_hub_source_uses_datasets(monkeypatch):
    calls = []

    def load_dataset(name, *args, split):
        calls.append((name, args, split))
        if name == "openai/gsm8k":
            return [{"question": "q1", "answer": "a\n#### 5"}, {"question": "q2", "answer": "b\n#### 6"}]
        return [{"problem": "p", "solution": "\\boxed{1}", "answer": "1"}, {"problem": "p2", "answer": ""}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows = load_gsm8k("train", limit=1, source="hub")
    assert [r["answer"] for r in rows] == ["5"] and rows[0]["prompt"] == "q1"
    assert calls[0] == ("openai/gsm8k", ("main",), "train")
    with pytest.raises(ValueError, match=r"HuggingFaceH4/MATH-500\[test\] row 2: field 'answer' is empty"):
        load_math500("test", source="hub")


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
