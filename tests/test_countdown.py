"""The Countdown task (qerl_kit.tasks.countdown): generation, disjoint splits, exact scoring without
eval, the format reward, the solver, and the task through the registry."""

import time
from fractions import Fraction

import pytest

from qerl_kit.tasks import countdown as cd
from qerl_kit.tasks import make_task


def test_generated_problems_follow_the_rules_and_their_solutions_score_one():
    rows = cd.make_dataset("train", 240, seed=3)
    assert [r["level"] for r in rows[:6]] == [3, 4, 5, 3, 4, 5]
    for r in rows:
        nums, target = r["numbers"], r["target"]
        assert len(nums) == r["level"] and all(1 <= n <= cd.MAX_NUMBER for n in nums)
        assert cd.MIN_TARGET <= target <= cd.MAX_TARGET and target not in nums
        value, used = cd.parse_expression(r["solution"])
        assert value == target and not (set(used) - set(nums))
        assert len(used) == (r["level"] if r["level"] == 3 else r["level"] - 1)  # one distractor from level 4
        assert cd.score_countdown(f"some work\n#### {r['solution']}", nums, target) == 1.0
        assert r["answer"] == str(target) and str(target) in r["prompt"]
    assert len({cd.problem_key(r["numbers"], r["target"]) for r in rows}) == len(rows)  # no repeats


def test_splits_are_disjoint_and_generation_is_deterministic():
    train = cd.make_dataset("train", 400, seed=0)
    test = cd.make_dataset("test", 100, seed=0)
    keys = lambda rows: {cd.problem_key(r["numbers"], r["target"]) for r in rows}  # noqa: E731
    assert not keys(train) & keys(test)
    assert all(cd.split_of(r["numbers"], r["target"]) == "test" for r in test)
    assert cd.make_dataset("test", 100, seed=0) == test
    assert cd.make_dataset("test", 100, seed=1) != test
    # a reordering of a held-out problem's numbers is held out too
    r = test[0]
    assert cd.split_of(list(reversed(r["numbers"])), r["target"]) == "test"


@pytest.mark.parametrize("text,score", [
    ("#### (7+5)*3-4", 1.0),
    ("#### 3*(7+5)-4\nthat's it", 1.0),
    ("#### (7 + 5) * 3 - 4   ", 1.0),
    ("#### 7*5-4", 0.0),              # 31: a wrong value
    ("#### (7+5)*3-4-0", 0.0),        # 0 is not a given number
    ("#### (7+7)*3-10", 0.0),         # 7 used twice, 10 not given
    ("#### (7+5)*3-4)", 0.0),         # unbalanced
    ("#### 32", 0.0),                 # a number that was not given
    ("the answer is (7+5)*3-4", 0.0), # no ####
    ("#### 7/(5-3-(4-2))", 0.0),      # division by zero (and 2 not given)
    ("#### __import__('os')", 0.0),   # never evaluated as Python
    ("#### 07*5", 0.0),               # a leading zero is not a given number
])
def test_scoring_is_exact(text, score):
    assert cd.score_countdown(text, [7, 5, 3, 4], 32) == score


def test_scoring_uses_exact_fractions_and_each_number_at_most_as_given():
    assert cd.parse_expression("7*5-3") == (Fraction(32), [7, 5, 3])
    assert cd.parse_expression("7/(5-5)") is None and cd.parse_expression("7 5") is None
    assert cd.score_countdown("#### 7*5-3", [7, 5, 3, 4], 32) == 1.0   # a subset of the numbers is fine
    assert cd.score_countdown("#### (3/4)*8*8", [3, 4, 8, 8], 48) == 1.0  # 8 given twice, used twice
    assert cd.score_countdown("#### (3/4)*8*8", [3, 4, 8], 48) == 0.0
    assert cd.score_countdown("#### 1/3*3", [1, 3, 3], 1) == 1.0         # exact, not floating point
    assert cd.score_countdown("#### 10/4", [10, 4], 2) == 0.0            # 2.5, no integer division


def test_rewards_take_the_rows_columns_and_the_format_reward_is_small():
    comps = ["#### (7+5)*3-4", "#### 7+5", "no answer", "#### 7+99"]
    kw = dict(numbers=[[7, 5, 3, 4]] * 4, target=[32] * 4)
    assert cd.countdown_reward(None, comps, **kw) == [1.0, 0.0, 0.0, 0.0]
    assert cd.format_reward(None, comps, **kw) == [cd.FORMAT_SCORE, cd.FORMAT_SCORE, 0.0, 0.0]
    with pytest.raises(ValueError, match="'numbers' and 'target' columns"):
        cd.countdown_reward(None, comps)
    with pytest.raises(ValueError, match="4 completions but 1 'numbers'"):
        cd.countdown_reward(None, comps, numbers=[[1, 2]], target=[3])


def test_long_and_deep_inputs_are_refused_in_linear_time():
    t = time.perf_counter()
    assert cd.score_countdown("#### " + "(" * 100_000 + "1" + ")" * 100_000, [1], 1) == 0.0
    assert cd.score_countdown("#### " + "1+" * 500_000 + "1", [1], 1) == 0.0
    assert cd.score_countdown("x" * 1_000_000 + "####" * 200_000, [1], 1) == 0.0
    assert cd.parse_expression("(" * (cd.MAX_DEPTH + 1) + "1" + ")" * (cd.MAX_DEPTH + 1)) is None
    assert cd.parse_expression("(" * cd.MAX_DEPTH + "1" + ")" * cd.MAX_DEPTH) == (1, [1])
    assert time.perf_counter() - t < 2.0  # about 0.1 s; a quadratic scan would take minutes


def test_solver_finds_solutions_and_says_when_there_is_none():
    for r in cd.make_dataset("test", 30, seed=2):
        found = cd.solve(r["numbers"], r["target"])
        assert found is not None and cd.score_countdown(f"#### {found}", r["numbers"], r["target"]) == 1.0
    assert cd.solve([2, 2], 7) is None
    assert cd.solve([1, 1, 1], 4) is None


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="countdown level 6"):
        cd.make_dataset("train", 3, levels=(6,))
    with pytest.raises(ValueError, match="countdown split 'dev'"):
        cd.make_dataset("dev", 3)


def test_countdown_is_a_registered_task():
    from qerl_kit.config import DataConfig

    task = make_task(DataConfig(dataset="countdown", train_size=30, eval_size=9))
    assert task.name == "countdown" and len(task.train) == 30 and len(task.eval) == 9
    assert task.accuracy is cd.countdown_reward and task.max_new_tokens == 96
    row = task.eval[0]
    assert row["prompt"] in task.prompt(None, row)
    res = task.accuracy(None, [f"#### {row['solution']}"], numbers=[row["numbers"]], target=[row["target"]])
    assert res == [1.0]


def test_the_model_script_trains_saves_and_calibrates_in_smoke_mode(tmp_path):
    import json
    import random

    from scripts.train_countdown import main, near_miss

    rng = random.Random(0)
    for r in cd.make_dataset("train", 50, seed=1):
        miss = near_miss(r["solution"], r["numbers"], r["target"], rng)
        assert miss is not None and cd.score_countdown(f"#### {miss}", r["numbers"], r["target"]) == 0.0
        assert cd.format_reward(None, [f"#### {miss}"], numbers=[r["numbers"]], target=[r["target"]]) == [0.1]
    out = tmp_path / "model"
    summary = main(["--smoke", "--out", str(out)])
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 6 and set(report["calibration"]) == {"greedy_dense", "greedy_nvfp4", "sampled_t1_nvfp4"}
    assert summary["params"] > 0
    assert [c["step"] for c in report["curve"]] == [3, 6]
    early = main(["--smoke", "--out", str(tmp_path / "early"), "--stop-at-acc", "0"])
    assert early["steps"] == 3 and [c["step"] for c in early["curve"]] == [3]  # the first evaluation stops it
    replay = main(["--smoke", "--out", str(tmp_path / "replay"), "--stop-at-step", "4"])
    assert replay["steps"] == 4 and [c["step"] for c in json.loads(
        (tmp_path / "replay" / "train_report.json").read_text())["curve"]] == [3, 4]
    with pytest.raises(SystemExit):
        main(["--smoke", "--out", str(tmp_path / "bad"), "--stop-at-step", "7"])  # past --steps (6)
    with pytest.raises(FileExistsError, match="not empty"):
        main(["--smoke", "--out", str(out)])


def test_a_used_up_level_ends_with_a_clear_error_or_gives_way_to_the_others(monkeypatch):
    # level 3 has only ~2.9k distinct train problems; a small streak limit keeps the test quick
    monkeypatch.setattr(cd, "EXHAUSTED_AFTER", 300)
    with pytest.raises(ValueError, match=r"only \d+ distinct train problems exist at levels \(3,\)"):
        cd.make_dataset("train", 5000, levels=(3,))
    only3 = len({cd.problem_key(r["numbers"], r["target"]) for r in cd.make_dataset("train", 1500, levels=(3,))})
    assert only3 == 1500
    rows = cd.make_dataset("train", 6000, levels=(3, 4))
    levels = [r["level"] for r in rows]
    assert len({cd.problem_key(r["numbers"], r["target"]) for r in rows}) == 6000
    assert 1500 < levels.count(3) < 3000 < levels.count(4)  # level 3 used up, level 4 filled the rest
