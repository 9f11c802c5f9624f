"""One prompt-to-reward path: the task renders, the batch is tokenized once, training and evaluation
score a completion the same way (the reward's keyword arguments, its call-and-check and the
correctness rule: ``qerl_kit.scoring``)."""

import pytest
import torch

from qerl_kit.config import from_dict
from qerl_kit.data import chat_prompt
from qerl_kit.evaluate import evaluate_task
from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.scoring import is_correct, reward_kwargs
from qerl_kit.tasks import Task
from qerl_kit.trainer import Trainer
from tests.test_evaluate import TEMPLATE, ScriptedEngine
from tests.test_rollout import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROW = {"prompt": "one plus one", "answer": "2", "level": 1}
# a score per completion: exactly 1 (correct), just under 1 (not), None (not applicable: not), above 1 (correct)
GRADES = {"#### 2": 1.0, "almost": 0.999, "n/a": None, "#### 2, twice": 3.0}


def _graded(calls):
    def graded(prompts, completions, completion_ids, answer, level, **_):
        calls.append(dict(prompts=list(prompts), completions=list(completions), answer=list(answer),
                          level=list(level), completion_ids=[list(i) for i in completion_ids]))
        return [GRADES[c] for c in completions]
    return graded


def _counting(tok):
    """``tok``, recording every text it tokenizes (``tok(...)``, ``tok.encode(...)``)."""
    texts = []

    class Counting(type(tok)):
        def __call__(self, text=None, *args, **kwargs):
            texts.append(text)
            return super().__call__(text, *args, **kwargs)

        def encode(self, text, *args, **kwargs):
            texts.append(text)
            return super().encode(text, *args, **kwargs)

    tok.__class__ = Counting
    return tok, texts


def _config(tmp_path, **over):
    base = dict(rollout=dict(batch_size=8, group_size=4, max_new_tokens=4, temperature=1.0), aqn=dict(enabled=False),
                loss=dict(micro_batch=8), total_steps=2, save_every=0, output_dir=str(tmp_path / "run"))
    return from_dict({**base, **over})


def _policy():
    return attach_lora(build_model("qwen2-tiny", seed=0), r=2)


def test_scoring_keyword_arguments_are_the_raw_question_and_aligned_columns():
    kwargs = reward_kwargs([ROW, {"prompt": "q2", "answer": "5", "level": 2}], 2, ["a", "b", "c", "d"],
                           [[1], [2], [3], [4]])
    assert kwargs == dict(prompts=["one plus one"] * 2 + ["q2"] * 2, completions=["a", "b", "c", "d"],
                          completion_ids=[[1], [2], [3], [4]], answer=["2", "2", "5", "5"], level=[1, 1, 2, 2])
    assert [is_correct(s) for s in (1.0, 0.999, None, 3.0, 0)] == [True, False, False, True, False]


@pytest.mark.filterwarnings("ignore:every reward function returned None")  # the n/a completion: reward 0
def test_training_and_evaluation_score_one_completion_the_same_way(tmp_path):
    tok = make_tokenizer(chat_template=TEMPLATE)
    train_calls, eval_calls = [], []
    task = Task("one", [ROW], [ROW], (_graded(train_calls),), chat_prompt)
    rendered = task.prompt(tok, ROW)
    assert rendered != ROW["prompt"] and "<|assistant|>" in rendered  # the policy sees the chat-rendered text
    engine = ScriptedEngine({rendered: list(GRADES)})
    trainer = Trainer(_policy(), tok, task, _config(tmp_path), engine=engine, progress="none")
    batch, rewards, metrics = trainer._collect(0)
    assert engine.calls[0][0] == [rendered, rendered]  # the engine got the rendered prompts
    same = Task("one", [ROW], [ROW], (_graded(eval_calls),), chat_prompt)  # the same task, recording apart
    result = evaluate_task(same, None, tok, engine=ScriptedEngine({rendered: list(GRADES)}), samples=4,
                           temperature=1.0)
    first_group = {k: v[:4] for k, v in train_calls[0].items()}
    # the same keyword arguments: the raw question (not the rendered prompt), the completions, the columns
    assert first_group == eval_calls[0]
    assert eval_calls[0]["prompts"] == [ROW["prompt"]] * 4 and eval_calls[0]["completions"] == list(GRADES)
    # one correctness rule: 1.0 and 3.0 are correct, 0.999 and None are not, in both
    correct = [is_correct(s) for s in result.per_problem[0]["scores"]]
    assert correct == [True, False, False, True]
    assert metrics["accuracy"] == result.accuracy == result.per_problem[0]["pass_rate"] == 0.5
    assert result.per_problem[0]["scores"] == [1.0, 0.999, None, 3.0]
    assert [rewards[i].item() for i in (0, 1, 3)] == pytest.approx([1.0, 0.999, 3.0])


def test_a_prompt_is_tokenized_once_per_rollout_and_once_per_evaluation_chunk(tmp_path):
    tok, texts = _counting(make_tokenizer(chat_template=TEMPLATE))
    rows = [{"prompt": p, "answer": "1"} for p in ("ab", "cd", "ef")]
    flat = lambda completions, **_: [0.0] * len(completions)  # noqa: E731  (equal rewards: every round refilled
    task = Task("flat", rows, rows[:2], (flat,), chat_prompt)
    trainer = Trainer(_policy(), tok, task, _config(tmp_path, filters=dict(dynamic_sampling=True,
                                                                             max_sampling_rounds=2)),
                      progress="none")
    texts.clear()  # the engine's set-up (its stop tokens) is not a prompt
    trainer.train(1)
    assert trainer.history[0]["sampling/rounds"] == 2
    # one tokenizer call per rollout round, holding the round's rendered prompts
    assert len(texts) == 2 and all(isinstance(t, list) and len(t) == 2 for t in texts)
    assert all(p in {task.prompt(tok, r) for r in rows} for t in texts for p in t)
    texts.clear()
    trainer.evaluate(batch_size=1, max_new_tokens=2)
    assert texts == [[task.prompt(tok, rows[0])], [task.prompt(tok, rows[1])]]  # one call per chunk


def test_vllm_length_budget_tokenizes_the_prompts_once_as_the_rollouts_will(monkeypatch):
    from qerl_kit.config import RolloutConfig
    from qerl_kit.rollout.registry import engine_options

    tok, texts = _counting(make_tokenizer(chat_template=TEMPLATE))
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (3, 70, 5)]
    task = Task("lengths", rows, rows[:1], (lambda completions, **_: [0.0] * len(completions),), chat_prompt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no memory share to plan: the length alone
    opts = engine_options(RolloutConfig(engine="vllm", max_new_tokens=10), _policy(), tok, task, 2)
    assert len(texts) == 1 and len(texts[0]) == 4  # the 3 train rows and the eval row, in one call
    longest = max(map(len, task.encode(tok, rows).ids))
    assert longest > 70 and opts == {"max_model_len": -(-(longest + 10) // 64) * 64}
