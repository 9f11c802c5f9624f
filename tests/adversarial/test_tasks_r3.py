"""Round 3 of "Nothing silently wrong": a task's construction, an engine's stop ids, evaluate's arguments.

Rows 13-16 and 18-22 of the third trial (2026-12-04), tried on the code fixed in rounds 1 and 2:

* ``Task`` checks what it is given when it is made (``qerl_kit.data.check_rows``, shared with
  ``evaluate``): each split a list of rows (never one dict, whose keys would become the rows), each
  row's ``prompt`` a non-empty string (never None or a number rendered as "None"/"5"); ``rewards``
  one callable or a list of them (a string is named as given, not by its first character);
  ``max_new_tokens`` by the shared completion-budget rule, naming the task;
* every engine (HF, static, vLLM) checks its extra ``stop_token_ids`` where it is built
  (``rollout.base.check_stop_ids``): ints inside the model's vocabulary, never a float truncated to
  another id, a string read as its characters, or an id that can never be generated;
* ``evaluate`` checks its seed and temperature by the shared rules and its dataset as a Task's
  rows; ``EvalResult.by`` refuses a column no row has (listing the columns) and ``example_rows`` a
  negative count.
"""

import json

import pytest

from qerl_kit.config_types import ConfigError
from qerl_kit.evaluate import evaluate
from qerl_kit.rewards import gsm8k_reward
from qerl_kit.rollout import HFEngine, StaticEngine
from qerl_kit.rollout.vllm import VLLMEngine
from qerl_kit.tasks import Task
from tests.test_evaluate import ROWS, ScriptedEngine, exact_reward
from tests.test_rollout import make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ROW = {"prompt": "Zoe has 4 stickers. She finds 1 more. How many?", "answer": "5"}


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()  # 512 ids


@pytest.fixture(scope="module")
def model():
    return make_model()


# ----------------------------------------------------------------------------- Task construction

def test_r3_13_a_dict_instead_of_a_list_of_rows_is_refused():
    """Task("t", {"prompt": "..."}, eval_rows, rewards, prompt_fn): one dict where a list of rows goes
    (its keys would become the training rows); also a string, and a list of strings."""
    for train in (dict(ROW), "prompt", ["abc", "def"]):
        with pytest.raises(TypeError, match=r"task 't': train.* must be a (list of rows|row)") as err:
            Task("t", train, [ROW], (gsm8k_reward,))
        assert "prompt" in str(err.value)
    with pytest.raises(TypeError, match=r"one row\? wrap it in a list"):
        Task("t", dict(ROW), [ROW], (gsm8k_reward,))
    with pytest.raises(TypeError, match=r"task 't': eval must be a list of rows"):
        Task("t", [ROW], dict(ROW), (gsm8k_reward,))
    task = Task("t", (dict(ROW) for _ in range(3)), None, gsm8k_reward)  # any iterable of rows; no eval rows
    assert task.train == [ROW] * 3 and task.eval == []


def test_r3_14_a_prompt_that_is_not_text_is_refused():
    """Task("t2", [{"prompt": None, "answer": "5"}] * 4, ...); rows with {"prompt": 5}; a blank prompt."""
    for prompt, kind in ((None, TypeError), (5, TypeError), ("", ValueError), ("  \n", ValueError)):
        with pytest.raises(kind, match=r"task 't2': train\[0\]\['prompt'\] must be a non-empty string") as err:
            Task("t2", [{"prompt": prompt, "answer": "5"}] * 4, [ROW], (gsm8k_reward,))
        assert repr(prompt) in str(err.value)
    with pytest.raises(TypeError, match=r"task 't2': eval\[1\]\['prompt'\] .* got 5"):
        Task("t2", [ROW], [ROW, {"prompt": 5, "answer": "5"}], (gsm8k_reward,))


def test_r3_15_a_reward_given_by_name_is_named_as_given():
    """Task("t", [{"prompt": "a"}], [], "math_reward"): a string, not its first character 'm'."""
    with pytest.raises(TypeError, match=r"task 't': rewards must be a reward function .*got 'math_reward' "
                                        r"\(pass the function itself"):
        Task("t", [{"prompt": "a"}], [], "math_reward")
    with pytest.raises(TypeError, match=r"task 't': rewards\[1\] must be a callable reward function; got None"):
        Task("t", [{"prompt": "a"}], [], [gsm8k_reward, None])
    with pytest.raises(TypeError, match=r"rewards must be .*got \{'math'"):  # a dict: its keys are not functions
        Task("t", [{"prompt": "a"}], [], {"math": gsm8k_reward})
    with pytest.raises(TypeError, match=r"task 't': accuracy_fn must be None .*got 'gsm8k_reward'"):
        Task("t", [{"prompt": "a"}], [], gsm8k_reward, accuracy_fn="gsm8k_reward")


def test_r3_16_a_task_completion_budget_is_checked_when_the_task_is_made():
    """Task(..., max_new_tokens=-5) or max_new_tokens="x": refused at construction, naming the task."""
    for value in (-5, 0, "x", 2.5, True):
        with pytest.raises(ConfigError, match=r"task 't': max_new_tokens must be null or an int >= 1") as err:
            Task("t", [{"prompt": "a"}], [], gsm8k_reward, max_new_tokens=value)
        assert err.value.key == "task 't': max_new_tokens"
    assert Task("t", [{"prompt": "a"}], [], gsm8k_reward, max_new_tokens=64).max_new_tokens == 64


# ----------------------------------------------------------------------------- engines' stop ids

def test_r3_18_stop_ids_outside_the_vocabulary_or_not_ints_are_refused(model, tok, tmp_path):
    """HFEngine(m, tok, stop_token_ids=[10**6]) (or [-1]); stop_token_ids=[2.7]; the StaticEngine and
    vLLM engine (checked before vLLM starts, against the checkpoint's vocab_size) the same."""
    for ids, kind, shown in (([10**6], ValueError, "1000000"), ([-1], ValueError, "-1"), ([2.7], TypeError, "2.7"),
                             ([True], TypeError, "True"), (3.0, TypeError, "3.0")):
        for build in (lambda: HFEngine(model, tok, stop_token_ids=ids),
                      lambda: StaticEngine(model, tok, stop_token_ids=ids)):
            with pytest.raises(kind, match=r"stop_token_ids must be None or token ids \(ints in \[0, 512\)") as err:
                build()
            assert shown in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 512}))
    with pytest.raises(ValueError, match=r"stop_token_ids must be .*\[0, 512\).*got 512"):
        VLLMEngine(tmp_path, tok, stop_token_ids=[512])
    assert HFEngine(model, tok, stop_token_ids=[511, 7]).stop_token_ids[-2:] == [511, 7]  # in range: kept


def test_r3_19_stop_ids_given_as_text_name_the_argument(model, tok, tmp_path):
    """HFEngine(m, tok, stop_token_ids="abc"); stop_token_ids=['<|im_end|>'] (a token's text, not its id)."""
    for ids in ("abc", ["<|im_end|>"]):
        for build in (lambda: HFEngine(model, tok, stop_token_ids=ids),
                      lambda: StaticEngine(model, tok, stop_token_ids=ids),
                      lambda: VLLMEngine(tmp_path, tok, stop_token_ids=ids)):
            with pytest.raises(TypeError, match=r"stop_token_ids must be None or token ids") as err:
                build()
            assert ("'abc'" if ids == "abc" else "'<|im_end|>'") in str(err.value)
    with pytest.raises(TypeError, match=r"convert_tokens_to_ids"):
        HFEngine(model, tok, stop_token_ids="<eos>")


# ----------------------------------------------------------------------------- evaluate

def test_r3_20_a_seed_that_is_not_an_int_is_named():
    """evaluate(m, tok, rows, fn, seed='x', max_new_tokens=2); also temperature='x'."""
    for kwargs, key in ((dict(seed="x"), "seed"), (dict(seed=-1), "seed"), (dict(seed=2.5), "seed"),
                        (dict(temperature="x"), "temperature")):
        engine = ScriptedEngine()
        with pytest.raises(ConfigError, match=rf"^{key} must be ") as err:
            evaluate(None, make_tokenizer(), ROWS, exact_reward, engine=engine, max_new_tokens=2, **kwargs)
        assert err.value.key == key and engine.calls == []  # refused before anything is generated


def test_r3_21_a_dataset_that_is_not_a_list_of_rows_is_named():
    """evaluate(m, tok, {"prompt": "1+1="}, fn): one dict, not a list of rows; rows whose prompt is None."""
    tok = make_tokenizer()
    with pytest.raises(TypeError, match=r"dataset must be a list of rows .*got \{'prompt': '1\+1='\} \(one row\?"):
        evaluate(None, tok, {"prompt": "1+1="}, exact_reward, engine=ScriptedEngine(), max_new_tokens=2)
    with pytest.raises(TypeError, match=r"dataset\[1\] must be a row"):
        evaluate(None, tok, [ROWS[0], "two times three"], exact_reward, engine=ScriptedEngine())
    with pytest.raises(TypeError, match=r"dataset\[0\]\['prompt'\] must be a non-empty string .*got None"):
        evaluate(None, tok, [{"prompt": None, "answer": "2"}], exact_reward, engine=ScriptedEngine())


def test_r3_22_by_a_column_no_row_has_and_a_negative_count_are_refused():
    """res = evaluate(..., samples=2) on rows with a `level` column; res.by("levle"); res.example_rows(k=-1)."""
    res = evaluate(None, make_tokenizer(), ROWS, exact_reward, engine=ScriptedEngine(), samples=2,
                   temperature=1.0, max_new_tokens=2)
    with pytest.raises(ConfigError, match=r"'levle' matches no column; the column names are: 'level' "
                                          r"\(did you mean 'level'"):
        res.by("levle")
    assert sorted(res.by("level")) == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"^k must be an int >= 0 .*got -1"):
        res.example_rows(k=-1)
    assert len(res.example_rows(k=0)) == 0 and len(res.example_rows(k=2)) == 2
    plain = evaluate(None, make_tokenizer(), [{"prompt": "q", "answer": "1"}], exact_reward, engine=ScriptedEngine(),
                     max_new_tokens=2)
    with pytest.raises(ValueError, match=r"no column to split by"):
        plain.by("level")
