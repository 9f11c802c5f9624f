"""The main job: a short smoke run, and the full demo (slow) that must really learn."""

import json
import os
import shutil

import pytest

from qerl_kit.demo import run_demo


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One 3-step demo run (AQN on, three stages) that the tests below read; (its dir, its summary)."""
    out = tmp_path_factory.mktemp("demo") / "run"
    return out, run_demo(steps=3, eval_size=16, output_dir=str(out), progress="none")


def test_demo_smoke_writes_summary_plot_and_metrics(smoke_run):
    out, summary = smoke_run
    for key in ("base_accuracy", "final_accuracy", "steps", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 3 and 0 <= summary["base_accuracy"] <= 1
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "curves.png").stat().st_size > 10_000
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert (out / "checkpoint-3" / "adapter_model.safetensors").is_file()


def test_demo_keeps_other_files_and_moves_an_earlier_run_aside(smoke_run, tmp_path):
    first_dir, first = smoke_run
    shutil.copytree(first_dir, tmp_path, dirs_exist_ok=True)  # an earlier run's files, left as the demo wrote them
    (tmp_path / "notes.txt").write_text("keep me")
    run_demo(steps=1, eval_size=4, output_dir=str(tmp_path), progress="none")   # before: the first run was deleted
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    [earlier] = (tmp_path / "previous-runs").iterdir()
    assert json.loads((earlier / "summary.json").read_text()) == first
    assert (earlier / "checkpoint-3" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 1
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.yaml").write_text("mine: 1\n")          # our file name, not a run's
    with pytest.raises(FileExistsError, match="not a qerl run's files"):
        run_demo(steps=1, eval_size=4, output_dir=str(tmp_path / "own"), progress="none")
    assert (tmp_path / "own" / "config.yaml").read_text() == "mine: 1\n"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QERL_SKIP_SLOW") == "1", reason="QERL_SKIP_SLOW=1")
def test_full_demo_learns_at_least_15_points_within_10_minutes(tmp_path):
    summary = run_demo(output_dir=str(tmp_path / "run"), progress="none")
    assert summary["eval_problems"] == 200 and summary["steps"] == 30
    assert summary["final_accuracy"] - summary["base_accuracy"] >= 0.15, summary
    assert 0.2 <= summary["base_accuracy"] <= 0.5  # the calibration band of the shipped model
    assert summary["wall_seconds"] < 600, summary
