"""Round 2 of "Nothing silently wrong": data, tasks, and reward checks in evaluation.

Rows 14-18, 30-33 of the second trial (2026-12-04):

* ``data.eval_dataset`` is refused where a task would ignore it, and a missing file names the key;
* a ``.jsonl`` dataset honours ``train_size`` (as the gsm8k/math500 tasks do), and its held-out rows
  are never trained on;
* a JSON Lines row with a key twice, or with its own ``prompt``/``solution`` column that the loader
  would overwrite, is a DataError naming file:line and the key;
* a reward function is called and checked the same way in training and in evaluation
  (``qerl_kit.scoring.reward_scores``: ``evaluate``, ``evaluate_task``, ``Trainer.evaluate`` and
  ``qerl eval``): a dict, None, strings, NaN or inf is an error naming the function, and an
  exception it raises is re-raised naming it.
"""

import json
import re
import types

import pytest
import torch

from qerl_kit.config import DataConfig, TrainConfig, from_dict
from qerl_kit.config_types import ConfigError
from qerl_kit.data import DataError, load_gsm8k, load_math500
from qerl_kit.evaluate import evaluate
from qerl_kit.scoring import score_rollouts
from qerl_kit.tasks import TASKS, Task, make_task
from qerl_kit.trainer import Trainer
from tests.test_evaluate import ScriptedEngine
from tests.test_rollout import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _gsm(path, n, start=0):
    path.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}\n#### {2 * i}"})
                            + "\n" for i in range(start, start + n)))
    return path


# ----------------------------------------------------------------------------- tasks and data.* keys

def test_r2_14_eval_dataset_a_task_would_ignore_is_refused_and_a_missing_file_named(tmp_path):
    """data: {dataset: arith, eval_dataset: /nonexistent/eval.jsonl} (also eval_dataset: gsm8k)."""
    for value in ("/nonexistent/eval.jsonl", "gsm8k"):
        with pytest.raises(ConfigError, match=r"data\.eval_dataset must be .*task 'arith' holds out its own"):
            DataConfig(dataset="arith", eval_dataset=value)
        with pytest.raises(ConfigError, match=r"data\.eval_dataset"):  # the YAML/dict route: the same rule
            from_dict(dict(data=dict(dataset="gsm8k", eval_dataset=value)))
    data = _gsm(tmp_path / "mine.jsonl", 6)
    with pytest.raises(FileNotFoundError, match=r"data\.eval_dataset '/nonexistent/eval\.jsonl': no such file"):
        make_task(DataConfig(dataset=str(data), eval_dataset="/nonexistent/eval.jsonl"))
    evals = _gsm(tmp_path / "held.jsonl", 4, start=100)  # a .jsonl dataset uses it: all its rows train
    task = make_task(DataConfig(dataset=str(data), eval_dataset=str(evals), eval_size=3))
    assert len(task.train) == 6 and [r["answer"] for r in task.eval] == ["200", "202", "204"]


def test_r2_15_a_file_task_honours_train_size(tmp_path, monkeypatch):
    """A .jsonl dataset of 10 rows with data.train_size: 3 (and eval_size 2); the gsm8k task too."""
    data = _gsm(tmp_path / "ten.jsonl", 10)
    task = make_task(DataConfig(dataset=str(data), train_size=3, eval_size=2))
    assert len(task.train) == 3 and len(task.eval) == 2
    folder = tmp_path / "data"
    folder.mkdir()
    _gsm(folder / "gsm8k_train.jsonl", 8)
    _gsm(folder / "gsm8k_test.jsonl", 4, start=50)
    monkeypatch.setenv("QERL_DATA", str(folder))
    gsm = make_task(DataConfig(dataset="gsm8k", train_size=5, eval_size=2))
    assert len(gsm.train) == 5 and len(gsm.eval) == 2


def test_r2_16_a_jsonl_datasets_held_out_rows_are_not_trained_on(tmp_path):
    """A .jsonl dataset of 10 rows with data.eval_size: 3: eval = the first 3, train = the other 7."""
    data = _gsm(tmp_path / "ten.jsonl", 10)
    task = make_task(DataConfig(dataset=str(data), eval_size=3))
    train, held = {r["prompt"] for r in task.train}, {r["prompt"] for r in task.eval}
    assert len(train) == 7 and len(held) == 3 and not train & held
    assert [r["answer"] for r in task.eval] == ["0", "2", "4"]  # still the file's first rows (qerl eval --limit)
    everything = make_task(DataConfig(dataset=str(data)))  # default eval_size 200 holds out all 10
    assert len(everything.eval) == 10 and everything.train == []
    with pytest.raises(ValueError, match=r"no training rows: data\.eval_size 200 holds out all 10 rows"):
        Trainer(torch.nn.Linear(1, 1), None, everything, TrainConfig())


def test_r2_17_a_rows_own_solution_or_prompt_column_is_never_overwritten(tmp_path):
    """JSONL rows with their own `solution` (or `prompt`) column beside question/answer."""
    path = tmp_path / "own.jsonl"
    for column in ("solution", "prompt"):
        path.write_text(json.dumps({"question": "q", "answer": "#### 2"}) + "\n"
                        + json.dumps({"question": "q", "answer": "#### 2", column: "mine"}) + "\n")
        with pytest.raises(DataError, match=rf"own\.jsonl:2: the file's own column '{column}' \('mine'\) clashes"):
            load_gsm8k(path)
    path.write_text(json.dumps({"problem": "p", "answer": "1", "prompt": "another"}) + "\n")
    with pytest.raises(DataError, match=r"own\.jsonl:1: .*column 'prompt'"):
        load_math500(path)
    path.write_text(json.dumps({"question": "q", "answer": "#### 2", "solution": "#### 2", "prompt": "q"}) + "\n")
    assert load_gsm8k(path)[0]["solution"] == "#### 2"  # the same value is no clash: nothing is lost


def test_r2_18_a_key_twice_in_one_json_object_is_an_error(tmp_path):
    """JSONL row {"question": ..., "answer": "#### 2", "answer": "#### 7"} (and a nested duplicate)."""
    path = tmp_path / "dup.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "#### 2", "answer": "#### 7"}\n')
    with pytest.raises(DataError, match=r"dup\.jsonl:2: the key 'answer' appears twice"):
        load_gsm8k(path)
    path.write_text('{"question": "q", "answer": "#### 1", "meta": {"k": 1, "k": 2}}\n')
    with pytest.raises(DataError, match=r"dup\.jsonl:1: the key 'k' appears twice"):
        make_task(DataConfig(dataset=str(path)))


# ----------------------------------------------------------------------------- reward functions

N = 4
ROWS = [{"prompt": "one plus one", "answer": "2"}, {"prompt": "two plus two", "answer": "4"}]


def _train_scores(fn):
    """The training path: score_rollouts of 2 groups of 2 stub completions."""
    task = Task("t", ROWS, [], (fn,), lambda tok, row: row["prompt"])
    roll = types.SimpleNamespace(prompts=["p"] * N, texts=["#### 2"] * N, completion_id_lists=lambda: [[1]] * N)
    return score_rollouts(task, ROWS, roll, 2)


def _eval_scores(fn):
    """The evaluation path: evaluate() of the same 2 rows, 2 samples each (4 completions)."""
    return evaluate(None, make_tokenizer(), ROWS, fn, samples=2, temperature=1.0, engine=ScriptedEngine())


def r_dict(completions, **_):
    return {i: 1.0 for i in range(len(completions))}


def r_none(completions, **_):
    return None


def r_nan(completions, **_):
    return [float("nan")] * len(completions)


def r_inf(completions, **_):
    return [float("inf")] * len(completions)


def r_str_scores(completions, **_):
    return ["1.0"] * len(completions)


def r_abc(completions, **_):
    return ["abc"] * len(completions)


def r_string(completions, **_):
    return "1" * len(completions)


def r_raises(completions, **_):
    raise KeyError("answer")


def test_r2_30_a_reward_returning_a_dict_is_refused_naming_it():
    """A Task's reward fn `return {i: 1.0 for i in range(len(completions))}`."""
    for path in (_train_scores, _eval_scores):
        with pytest.raises(TypeError, match=r"reward function 'r_dict' returned a dict .*not a list of 4 scores"):
            path(r_dict)


def test_r2_31_a_reward_that_raises_is_re_raised_naming_it():
    """A reward fn that raises KeyError("answer"): training, and evaluation, name it."""
    for path in (_train_scores, _eval_scores):
        with pytest.raises(RuntimeError, match=r"reward function 'r_raises' raised KeyError\('answer'\) on a batch "
                                               r"of 4 completions \(the first: '") as err:
            path(r_raises)
        assert isinstance(err.value.__cause__, KeyError)  # the original, for its traceback


@pytest.mark.parametrize("fn, error, match", [
    (r_dict, TypeError, "returned a dict"),
    (r_nan, ValueError, "completion 0 is nan"),
    (r_inf, ValueError, "completion 0 is inf"),
    (r_str_scores, TypeError, r"a score of type str \('1\.0'\)"),
    (r_string, TypeError, r"returned a str \('1111'\)"),
])
def test_r2_32_evaluation_refuses_what_training_refuses(fn, error, match):
    """evaluate(pol, tok, rows, fn) with fn returning a dict / [nan]*n / [inf]*n / ['1.0']*n / '11...':
    the same error as in training, from the one check (scoring.reward_scores)."""
    with pytest.raises(error, match=rf"reward function '{fn.__name__}'.*{match}") as ev:
        _eval_scores(fn)
    with pytest.raises(error) as tr:
        _train_scores(fn)
    assert str(ev.value) == str(tr.value)


def test_r2_32_trainer_evaluate_and_qerl_eval_check_the_accuracy_reward(tmp_path, monkeypatch, capsys):
    """Trainer.evaluate and `qerl eval` with an accuracy reward returning [nan]*n."""
    from qerl_kit.cli import main
    from qerl_kit.lora import attach_lora
    from qerl_kit.models import build_model

    task = Task("letters", ROWS, ROWS[:1], (r_nan,), lambda tok, row: row["prompt"])
    cfg = from_dict(dict(rollout=dict(batch_size=4, group_size=2, max_new_tokens=2), save_every=0,
                         output_dir=str(tmp_path / "run")))
    trainer = Trainer(attach_lora(build_model("qwen2-tiny", seed=0), r=2), make_tokenizer(), task, cfg, progress="none")
    with pytest.raises(ValueError, match=r"reward function 'r_nan'.*completion 0 is nan"):
        trainer.evaluate(max_new_tokens=2)
    monkeypatch.setitem(TASKS, "nan_task", lambda cfg, seed: Task("nan_task", ROWS, ROWS, (r_nan,)))
    capsys.readouterr()
    assert main(["eval", "--dataset", "nan_task", "--limit", "1", "--format", "none", "--device", "cpu",
                 "--engine", "hf", "--max-new-tokens", "2"]) == 1  # one line, as every refusal
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(r"reward function 'r_nan'.*completion 0 is nan", err.splitlines()[-1])


def test_r2_33_evaluation_names_a_reward_returning_none_or_unparsable_strings():
    """evaluate(...) with fn returning None / ['abc']*n."""
    with pytest.raises(TypeError, match=r"reward function 'r_none' returned None"):
        _eval_scores(r_none)
    with pytest.raises(TypeError, match=r"reward function 'r_abc' returned a score of type str \('abc'\)"):
        _eval_scores(r_abc)


def test_numpy_scores_are_numbers_and_a_numpy_nan_is_named():
    """A reward function may return numpy scalars (np.float32, np.int64): they are scores, turned into
    floats; a numpy NaN is refused naming the function, as a Python NaN is."""
    import numpy as np

    from qerl_kit.finite import NonFiniteError
    from qerl_kit.scoring import checked_scores

    def np_reward(completions, **_):
        return [np.float32(0.5), np.int64(1)]

    scores = checked_scores(np_reward, np_reward(["a", "b"]), 2)
    assert scores == [0.5, 1.0] and all(type(s) is float for s in scores)

    def np_nan(completions, **_):
        return [np.float32("nan"), np.float64(0.0)]

    with pytest.raises(NonFiniteError, match="np_nan"):
        checked_scores(np_nan, np_nan(["a", "b"]), 2)
