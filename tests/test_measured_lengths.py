"""bench.measured_lengths: a real model's completion lengths, committed and resampled by the step bench."""

import json
import random

import pytest

from bench import measured_lengths as ml
from bench.step_lengths import draw_lengths


def _eval_file(path, lengths_per_problem, cap=4096, temperature=1.0, samples=4, model="/x/m.gguf"):
    meta = {"model": model, "format": "none", "dataset": "gsm8k"}
    if cap is not None:
        meta["max_new_tokens"] = cap
    per = [{"lengths": ls, "pass_rate": sum(i % 3 == 0 for i in range(len(ls))) / len(ls)}
           for ls in lengths_per_problem]
    path.write_text(json.dumps({"meta": meta, "temperature": temperature, "samples": samples, "per_problem": per}))
    return path


def _lengths(rng, problems, samples=4, top=900):
    return [[rng.randint(1, top) for _ in range(samples)] for _ in range(problems)]


def test_build_keeps_every_completion_and_states_the_tail_with_intervals(tmp_path):
    rng = random.Random(7)
    a, b = _lengths(rng, 5), _lengths(rng, 3)
    a[0][0] = 4096  # one completion that never stopped
    data = ml.build([_eval_file(tmp_path / "a.json", a), _eval_file(tmp_path / "b.json", b)], tmp_path / "out")
    assert data["lengths"] == [x for row in a + b for x in row] and data["problems"] == 8
    assert data["completions"] == 32 and data["max_new_tokens"] == 4096 and data["model"] == "m.gguf"
    assert json.loads((tmp_path / "out" / "lengths.json").read_text()) == data
    md = (tmp_path / "out" / "lengths.md").read_text()
    k512 = sum(x >= 512 for x in data["lengths"])
    lo, hi = ml.wilson(k512, 32)
    assert f"| >= 512 tokens | {k512} | {k512 / 32:.3f} | {lo:.3f} - {hi:.3f} |" in md
    assert "| at the cap (4096) | 1 | 0.031 |" in md
    assert f"| {max(data['lengths'])} |" in md


def test_wilson_is_sound_where_nothing_was_seen():
    lo, hi = ml.wilson(0, 128)
    assert lo == 0.0 and 0.025 < hi < 0.035  # about 3 / n: a share of 4% is outside it
    lo, hi = ml.wilson(64, 128)
    assert lo < 0.5 < hi and hi - lo < 0.2


def test_files_of_different_settings_or_an_unknown_cap_are_refused(tmp_path):
    rng = random.Random(1)
    a = _eval_file(tmp_path / "a.json", _lengths(rng, 2))
    with pytest.raises(ValueError, match="differ in model, temperature or samples"):
        ml.build([a, _eval_file(tmp_path / "b.json", _lengths(rng, 2), temperature=0.6)], tmp_path / "o")
    old = _eval_file(tmp_path / "c.json", _lengths(rng, 2), cap=None)  # written before qerl eval recorded it
    with pytest.raises(ValueError, match="give --max-new-tokens"):
        ml.build([old], tmp_path / "o")
    assert ml.build([old], tmp_path / "o", max_new_tokens=4096)["max_new_tokens"] == 4096
    with pytest.raises(ValueError, match="disagree on the cap"):
        ml.build([a], tmp_path / "o", max_new_tokens=2048)
    with pytest.raises(ValueError, match="longer than the cap"):
        ml.build([_eval_file(tmp_path / "d.json", [[600, 9]], cap=None)], tmp_path / "o", max_new_tokens=512)


def test_the_step_bench_resamples_a_measurement(tmp_path):
    rng = random.Random(3)
    ml.build([_eval_file(tmp_path / "a.json", _lengths(rng, 6))], tmp_path / "m")
    path = tmp_path / "m" / "lengths.json"
    pool = set(json.loads(path.read_text())["lengths"])
    drawn = draw_lengths(f"measured:{path}", 64, seed=0)
    assert set(drawn["lengths"]) <= pool and len(set(drawn["lengths"])) > 5 and drawn["max_new_tokens"] == 4096
    assert drawn == draw_lengths(f"measured:{path}", 64, seed=0)
    assert drawn["lengths"] != draw_lengths(f"measured:{path}", 64, seed=1)["lengths"]
    half = draw_lengths(f"measured:{path}", 64, max_new_tokens=2048, seed=0)  # a lower cap scales every length
    assert half["lengths"] == [max(1, round(x / 2)) for x in drawn["lengths"]] and half["max_new_tokens"] == 2048
    with pytest.raises(ValueError, match="no such measurement; use one of real05b"):
        draw_lengths("measured:nope", 4)
    bad = tmp_path / "bad.json"
    for text, why in (("{", "not a lengths.json"), ('{"lengths": [3, 0], "max_new_tokens": 8}', "ints in")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=why):
            draw_lengths(f"measured:{bad}", 4)
    bad.write_text('{"lengths": [3, 5], "max_new_tokens": 8}')  # a bare file: the draw needs nothing else
    assert set(draw_lengths(f"measured:{bad}", 6)["lengths"]) <= {3, 5}


@pytest.mark.parametrize("name", sorted(ml.MEASURED))
def test_the_committed_real_model_measurements_load(name):
    if not ml.MEASURED[name].is_file():
        pytest.fail(f"{ml.MEASURED[name]} is missing: it is committed with bench/measured_lengths.py")
    data = ml.load(name)
    assert data["completions"] == len(data["lengths"]) >= 128 and data["max_new_tokens"] == 4096
    drawn = draw_lengths(f"measured:{name}", 128)
    assert drawn["max_length"] <= max(data["lengths"])
