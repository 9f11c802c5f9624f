"""evaluate(): pass@1 bookkeeping with a scripted engine, then end to end with HFEngine and LoRA.

Run: python -m pytest tests/test_evaluate.py -q
"""

import contextlib

import pytest
import torch

from qerl_kit.data import build_prompt
from qerl_kit.evaluate import EvalResult, evaluate
from qerl_kit.rollout import HFEngine, Prompts, RolloutEngine, Rollouts, SamplingParams
from tests.test_rollout import make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


class ScriptedEngine:
    """A RolloutEngine whose completions come from a table: prompt -> list of texts (cycled)."""

    def __init__(self, table=None, default="?"):
        self.table, self.default, self.calls, self.syncs = table or {}, default, [], []

    def sync(self, policy=None, *, noise=None, step=0):
        self.syncs.append((policy, noise))
        return contextlib.nullcontext({})

    def generate(self, prompts, n, sampling):
        assert isinstance(prompts, Prompts) and all(prompts.ids)  # token ids, tokenized once by evaluate
        prompts = list(prompts.texts)
        self.calls.append((prompts, n, sampling))
        texts = [self.table.get(p, [self.default])[j % len(self.table.get(p, [self.default]))]
                 for p in prompts for j in range(n)]
        ids = [[3 + ord(c) % 500 for c in t] + [1] for t in texts]
        return Rollouts.from_lists([p for p in prompts for _ in range(n)], [[5, 6]] * len(texts), ids,
                                   [[-0.1] * len(i) for i in ids], texts, ["stop"] * len(texts), n, 0,
                                   stats={"rollout/tokens": sum(map(len, ids)), "rollout/seconds": 0.5})


def exact_reward(prompts=None, completions=(), answer=None, **kwargs):
    """1.0 for '#### <answer>', 0.5 for the bare answer (partial: not correct), None without a gold."""
    return [None if a is None else 1.0 if c == f"#### {a}" else 0.5 if c == str(a) else 0.0
            for c, a in zip(completions, answer)]


ROWS = [{"prompt": "one plus one", "answer": "2", "level": 1},
        {"prompt": "two times three", "answer": "6", "level": 2},
        {"prompt": "unanswerable", "answer": None, "level": 3}]


def test_pass_at_1_threshold_none_and_reward_columns():
    tok = make_tokenizer()
    render = lambda r: build_prompt(tok, r["prompt"])  # noqa: E731
    engine = ScriptedEngine({render(ROWS[0]): ["#### 2"],
                             render(ROWS[1]): ["#### 6", "6", "#### 7", "nothing"],
                             render(ROWS[2]): ["#### 1"]})
    seen = {}

    def reward(**kwargs):
        seen.update(kwargs)
        return exact_reward(**kwargs)

    res = evaluate(None, tok, ROWS, reward, samples=4, temperature=0.7, top_p=0.9, max_new_tokens=9,
                   batch_size=2, engine=engine, seed=10)
    assert isinstance(engine, RolloutEngine)
    assert res.samples == 4 and res.num_problems == 3
    assert [p["pass_rate"] for p in res.per_problem] == [1.0, 0.25, 0.0]   # 0.5 and None are incorrect
    assert res.accuracy == pytest.approx((1.0 + 0.25 + 0.0) / 3)
    assert res.per_problem[1]["completions"] == ["#### 6", "6", "#### 7", "nothing"]
    assert res.per_problem[1]["scores"] == [1.0, 0.5, 0.0, 0.0] and res.per_problem[2]["scores"] == [None] * 4
    assert res.per_problem[1]["lengths"] == [7, 2, 7, 8]
    assert res.mean_length == pytest.approx(sum(L for p in res.per_problem for L in p["lengths"]) / 12)
    # two engine calls of <= 2 problems, n = samples, seeds seed + chunk index, sampling passed on
    assert [len(c[0]) for c in engine.calls] == [2, 1] and all(c[1] == 4 for c in engine.calls)
    assert [c[2] for c in engine.calls] == [SamplingParams(9, 0.7, 0.9, 0, seed) for seed in (10, 11)]
    assert engine.syncs == [(None, None)] * 2  # each call inside engine.sync (a vLLM engine gets the adapter there)
    # the last call's reward kwargs: TRL-style columns, repeated per sample, group-contiguous
    assert seen["prompts"] == ["unanswerable"] * 4 and seen["answer"] == [None] * 4
    assert seen["level"] == [3] * 4 and seen["completion_ids"][0][-1] == 1
    assert res.stats["rollout/seconds"] == 1.0 and res.stats["rollout/tokens_per_s"] > 0


def test_default_prompt_uses_chat_template_and_custom_prompt_fn():
    for template, marker in [(TEMPLATE, "<|assistant|>"), (None, "\nAnswer:")]:
        tok = make_tokenizer(chat_template=template)
        engine = ScriptedEngine()
        evaluate(None, tok, ROWS[:2], exact_reward, engine=engine)
        sent = engine.calls[0][0]
        assert sent == [build_prompt(tok, r["prompt"]) for r in ROWS[:2]]
        assert all(s.endswith(marker) and r["prompt"] in s for s, r in zip(sent, ROWS))
    engine = ScriptedEngine()
    evaluate(None, tok, ROWS[:2], exact_reward, engine=engine, prompt_fn=lambda t, r: r["prompt"].upper())
    assert engine.calls[0][0] == ["ONE PLUS ONE", "TWO TIMES THREE"]


def test_greedy_samples_once_and_errors():
    engine = ScriptedEngine()
    with pytest.warns(UserWarning, match="greedy"):
        res = evaluate(None, make_tokenizer(), ROWS, exact_reward, samples=4, temperature=0, engine=engine)
    assert res.samples == 1 and engine.calls[0][1] == 1 and engine.calls[0][2].greedy
    assert engine.calls[0][2].top_p == 1.0
    with pytest.raises(ValueError, match="empty"):
        evaluate(None, make_tokenizer(), [], exact_reward, engine=engine)
    with pytest.raises(ValueError, match="no 'prompt' column"):
        evaluate(None, make_tokenizer(), [{"question": "q", "answer": "1"}], exact_reward, engine=engine)
    with pytest.raises(ValueError, match="2 scores for 3"):
        evaluate(None, make_tokenizer(), ROWS, lambda completions, **kw: [1.0, 0.0], engine=engine)
    with pytest.raises(ValueError, match="samples"):
        evaluate(None, make_tokenizer(), ROWS, exact_reward, samples=0, engine=engine)
    with pytest.raises(ValueError, match="pass a model"):
        evaluate(None, make_tokenizer(), ROWS, exact_reward)


def test_summary_html_and_dataframe():
    engine = ScriptedEngine(default="#### 2")
    res = evaluate(None, make_tokenizer(), ROWS, exact_reward, samples=2, engine=engine)
    assert isinstance(res, EvalResult)
    text = str(res)
    assert "accuracy 0.3333" in text and "2 sample(s)" in text and "one plus one" in text
    page = res._repr_html_()
    assert "<table>" in page and "two times three" in page
    pd = pytest.importorskip("pandas")
    df = res.to_dataframe()
    assert isinstance(df, pd.DataFrame) and len(df) == 3 and df["pass_rate"].tolist() == [1.0, 0.0, 0.0]



def test_save_writes_the_summary_meta_and_completions_in_one_piece(tmp_path):
    import json

    res = evaluate(None, make_tokenizer(), ROWS, exact_reward, samples=2, engine=ScriptedEngine(default="#### 2"))
    out = tmp_path / "eval" / "result.json"  # a folder that does not exist yet
    res.save(out, meta={"model": "tiny"})
    saved = json.loads(out.read_text())
    assert saved["meta"] == {"model": "tiny"} and saved["accuracy"] == res.accuracy
    assert [p["completions"] for p in saved["per_problem"]] == [p["completions"] for p in res.per_problem]
    assert sorted(p.name for p in out.parent.iterdir()) == ["result.json"]  # no temporary file left

# ----------------------------------------------------------------------------- real models

def test_evaluate_with_hf_engine_end_to_end():
    tok, model = make_tokenizer(), make_model()
    rows = [{"prompt": q} for q in ("2+3?", "Hi there", "fox")]
    prompts = [build_prompt(tok, r["prompt"]) for r in rows]
    greedy = HFEngine(model, tok).generate(prompts, 1, SamplingParams(8, temperature=0))
    rows = [dict(r, answer=t) for r, t in zip(rows, greedy.texts)]
    rows[2]["answer"] = "not what the model says"
    match = lambda completions, answer, **kw: [float(c == a) for c, a in zip(completions, answer)]  # noqa: E731
    res = evaluate(model, tok, rows, match, temperature=0, max_new_tokens=8, batch_size=2)
    assert res.accuracy == pytest.approx(2 / 3)
    assert [p["completions"][0] for p in res.per_problem] == greedy.texts
    sampled = evaluate(model, tok, rows, match, samples=3, temperature=1.0, top_p=1.0, max_new_tokens=8)
    again = evaluate(model, tok, rows, match, samples=3, temperature=1.0, top_p=1.0, max_new_tokens=8)
    assert sampled.per_problem == again.per_problem  # seeded by default
    assert all(len(p["completions"]) == 3 for p in sampled.per_problem)


def test_evaluation_applies_the_lora_adapter():
    """The official QeRL eval measured the base model; here a non-zero adapter must change results."""
    tok, model = make_tokenizer(), make_model(quantized=True, lora=True)
    rows = [{"prompt": q} for q in ("2+3?", "Hi there", "fox", "abc")]
    with model.disable_adapter():  # the base model's greedy answers are the gold
        base = evaluate(model, tok, rows, lambda completions, **kw: [0.0] * len(completions),
                        temperature=0, max_new_tokens=8)
    rows = [dict(r, answer=p["completions"][0]) for r, p in zip(rows, base.per_problem)]
    match = lambda completions, answer, **kw: [float(c == a) for c, a in zip(completions, answer)]  # noqa: E731
    with model.disable_adapter():
        assert evaluate(model, tok, rows, match, temperature=0, max_new_tokens=8).accuracy == 1.0
    adapted = evaluate(model, tok, rows, match, temperature=0, max_new_tokens=8)
    assert adapted.accuracy < 1.0
    with torch.no_grad():  # a zero adapter is the base model again
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    assert evaluate(model, tok, rows, match, temperature=0, max_new_tokens=8).accuracy == 1.0


def test_a_minimal_engine_works_and_pass_at_k_and_by_column():
    class Minimal:  # the rollout interface and nothing else: sync (nothing to do) and generate
        def sync(self, policy=None, *, noise=None, step=0):
            return contextlib.nullcontext({})

        def generate(self, prompts, n, sampling):
            return ScriptedEngine({prompts.texts[0]: ["#### 2", "#### 6"]}).generate(prompts, n, sampling)

    tok = make_tokenizer()
    res = evaluate(None, tok, ROWS, exact_reward, samples=2, temperature=1.0, engine=Minimal(), batch_size=1)
    assert [p["pass_rate"] for p in res.per_problem] == [0.5, 0.5, 0.0]  # "#### 2" right once, "#### 6" once
    assert res.pass_at_k == pytest.approx(2 / 3) and res.accuracy == pytest.approx(1 / 3)
    assert res.by("level") == {1: {"accuracy": 0.5, "pass_at_k": 1.0, "n": 1},
                               2: {"accuracy": 0.5, "pass_at_k": 1.0, "n": 1},
                               3: {"accuracy": 0.0, "pass_at_k": 0.0, "n": 1}}

    class GenerateOnly:  # no sync: AQN noise or an adapter upload could never reach it
        generate = Minimal.generate

    with pytest.raises(TypeError, match="GenerateOnly is not a rollout engine: it has no sync method"):
        evaluate(None, tok, ROWS, exact_reward, samples=2, temperature=1.0, engine=GenerateOnly(), batch_size=1)
