"""qerl_kit.experiments: grid validation, the lr rule, a real tiny grid, resume, views, CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("seaborn")

from qerl_kit import experiments as ex  # noqa: E402
from qerl_kit.experiments import GridConfig  # noqa: E402

TINY = dict(steps=2, batch_size=8, group_size=4, eval_size=4, max_new_tokens=24)


# ---- configurations --------------------------------------------------------------------------
def test_standard_grid_is_the_issue_s_six_configurations():
    grid = {c.name: c for c in ex.STANDARD_GRID}
    assert [(c.format, c.aqn) for c in ex.STANDARD_GRID] == [
        ("none", False), ("nf4", False), ("mxfp4", False), ("nvfp4", False), ("nvfp4", True), ("none", True)]
    assert grid["nvfp4-lora-aqn"].label == "NVFP4-LoRA + AQN" and grid["bf16-lora"].label == "bf16-LoRA"
    control = ex.lr_control()  # bf16 at the 4-bit lr: separates the lr rule from the weights
    assert (control.format, control.aqn, control.lr) == ("none", False, ex.TINY_LR)
    assert control.label == "bf16-LoRA, 4-bit lr" and control.name not in grid
    assert ex.GRIDS["reduced"][0] == ex.GRIDS["full"][0] == tuple(grid) + (control.name,)
    assert ex.resolve_configs([control.name], base_lr=1e-5)[0].lr == 1e-5


def test_lr_rule_bf16_at_half_the_4bit_lr():
    for base in (ex.TINY_LR, ex.PAPER_LR, 3e-4):
        grid = ex.standard_grid(base)
        for c in grid:
            assert c.lr == pytest.approx(base * 0.5 if c.format == "none" else base)
    assert ex.TINY_LR == 2e-3 and ex.PAPER_LR == 1e-5  # tiny-cpu preset; paper Table 4 (bf16 LoRA: 5e-6)
    bf16 = {c.name: c.lr for c in ex.STANDARD_GRID}
    assert bf16["bf16-lora"] == bf16["bf16-lora-aqn"] == 1e-3 < bf16["nvfp4-lora"] == 2e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="", format="nvfp4", aqn=False, lr=1e-3), "non-empty"),
    (dict(name="a/b", format="nvfp4", aqn=False, lr=1e-3), "non-empty"),
    (dict(name="x", format="int8", aqn=False, lr=1e-3), "format must be one of"),
    (dict(name="x", format="nvfp4", aqn=False, lr=0.0), "lr must be > 0"),
])
def test_grid_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GridConfig(**kwargs)


def test_resolve_configs_errors_name_the_problem():
    assert [c.name for c in ex.resolve_configs(["nvfp4-lora", "bf16-lora"])] == ["nvfp4-lora", "bf16-lora"]
    assert ex.resolve_configs(["bf16-lora"], base_lr=1e-5)[0].lr == 5e-6
    with pytest.raises(ValueError, match="unknown config 'fp8-lora'"):
        ex.resolve_configs(["fp8-lora"])
    with pytest.raises(ValueError, match="non-empty"):
        ex.resolve_configs([])
    with pytest.raises(ValueError, match="non-empty"):
        ex.resolve_configs("nvfp4-lora")  # a bare string is not a list of names
    with pytest.raises(ValueError, match="duplicate config"):
        ex.resolve_configs(["nvfp4-lora", "nvfp4-lora"])
    with pytest.raises(TypeError, match="GridConfig or str"):
        ex.resolve_configs([3])


@pytest.mark.parametrize("seeds, match", [([], "non-empty"), (0, "non-empty"), ([0, 0], "distinct"),
                                          ([-1], "non-negative"), ([1.5], "non-negative")])
def test_run_grid_rejects_bad_seeds_before_training(seeds, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        ex.run_grid(["nvfp4-lora"], seeds, output_dir=tmp_path, **TINY)
    assert not (tmp_path / "runs").exists()


def test_run_grid_validates_every_run_before_training_any(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ex, "run_one", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match="AQN, which needs at least 3 steps"):
        ex.run_grid(["nvfp4-lora", "nvfp4-lora-aqn"], [0], output_dir=tmp_path, **TINY)
    with pytest.raises(ValueError, match="multiple of"):
        ex.run_grid(["nvfp4-lora"], [0], output_dir=tmp_path, **{**TINY, "batch_size": 6})
    assert calls == []


def test_same_everything_but_format_aqn_and_lr():
    budget = ex.Budget(steps=20, batch_size=32, group_size=8, eval_size=50, seeds=(0,))
    cfgs = {c.name: ex.train_config(c, 3, budget) for c in ex.STANDARD_GRID}
    dicts = {n: c.to_dict() for n, c in cfgs.items()}
    for d in dicts.values():
        d["model"].pop("format"), d["optim"].pop("lr"), d["aqn"].pop("enabled"), d.pop("output_dir")
    first = next(iter(dicts.values()))
    assert all(d == first for d in dicts.values())  # data, rollout, loss, AQN schedule, seed: equal
    assert first["seed"] == 3 and first["aqn"]["stages"] == 10 and first["total_steps"] == 20
    assert cfgs["bf16-lora-aqn"].aqn.enabled and cfgs["bf16-lora-aqn"].model.format == "none"
    assert not cfgs["nvfp4-lora"].aqn.enabled


# ---- a real grid --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    metrics, summary = ex.run_grid(["nvfp4-lora", "bf16-lora"], [0], output_dir=out, device="cpu",
                                   log=lambda s: None, **TINY)
    return out, metrics, summary


def test_run_grid_returns_long_metrics_and_a_summary(tiny_grid):
    out, metrics, summary = tiny_grid
    assert len(metrics) == 2 * 1 * 2 and len(summary) == 2
    assert list(metrics[["config", "seed", "step"]].itertuples(index=False, name=None)) == [
        ("nvfp4-lora", 0, 1), ("nvfp4-lora", 0, 2), ("bf16-lora", 0, 1), ("bf16-lora", 0, 2)]
    for col in ("label", "reward", "entropy", "rollout_nll", "accuracy", "aqn/sigma", "lr"):
        assert col in metrics.columns
    assert metrics["entropy"].between(0, 6).all() and metrics["reward"].between(0, 1).all()
    assert metrics["rollout_nll"].notna().all() and (metrics["aqn/sigma"] == 0).all()
    assert dict(zip(metrics["config"], metrics["lr"])) == {"nvfp4-lora": 2e-3, "bf16-lora": 1e-3}
    s = summary.set_index("config")
    assert s.loc["nvfp4-lora", "initial_entropy"] == metrics.query("config == 'nvfp4-lora' and step == 1")["entropy"].item()
    for col in ("base_accuracy", "final_accuracy", "mean_reward", "wall_seconds"):
        assert summary[col].notna().all()
    assert s.loc["nvfp4-lora", "format"] == "nvfp4" and s.loc["bf16-lora", "format"] == "none"
    assert (summary["eval_size"] == 4).all()
    # on disk: the combined CSVs and one pair per run
    assert pd.read_csv(out / "metrics.csv").shape == metrics.shape
    assert pd.read_csv(out / "summary.csv")["config"].tolist() == ["nvfp4-lora", "bf16-lora"]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "bf16-lora_seed0_metrics.csv", "bf16-lora_seed0_summary.csv",
        "nvfp4-lora_seed0_metrics.csv", "nvfp4-lora_seed0_summary.csv"]


def test_resume_skips_finished_runs_and_trains_only_new_ones(tiny_grid, monkeypatch):
    out, metrics, summary = tiny_grid
    trained = []
    real = ex.run_one

    def counting(gc, seed, *args, **kwargs):
        trained.append((gc.name, seed))
        return real(gc, seed, *args, **kwargs)

    monkeypatch.setattr(ex, "run_one", counting)
    again, again_summary = ex.run_grid(["nvfp4-lora", "bf16-lora"], [0], output_dir=out, log=lambda s: None, **TINY)
    assert trained == []  # nothing re-trained, and the results read back are the same
    pd.testing.assert_frame_equal(again, metrics, check_dtype=False)
    assert again_summary["final_accuracy"].tolist() == summary["final_accuracy"].tolist()
    # a crashed grid: one run's summary missing -> only that run is trained again
    (out / "runs" / "bf16-lora_seed0_summary.csv").unlink()
    ex.run_grid(["nvfp4-lora", "bf16-lora"], [0], output_dir=out, log=lambda s: None, **TINY)
    assert trained == [("bf16-lora", 0)]
    with pytest.raises(ValueError, match=r"other settings.*'steps': \(2, 3\)"):
        ex.run_grid(["nvfp4-lora"], [0], output_dir=out, log=lambda s: None, **{**TINY, "steps": 3})


def test_eval_every_records_held_out_accuracy_without_touching_training(tiny_grid, tmp_path):
    _, metrics, _ = tiny_grid
    m, summary = ex.run_grid(["nvfp4-lora"], [0], output_dir=tmp_path, device="cpu", log=lambda s: None,
                             eval_every=1, **TINY)
    acc = m["eval/accuracy"]
    assert acc.notna().all() and acc.between(0, 1).all()
    assert summary["final_accuracy"].item() == acc.iloc[-1] and summary["eval_every"].item() == 1
    # the evaluations are greedy and seeded: the same training as the run without them, step by step,
    # and their tokens are not counted in the rollout NLL
    same = metrics[metrics.config == "nvfp4-lora"].reset_index(drop=True)
    assert same["eval/accuracy"].isna().all()
    for col in ("reward", "entropy", "rollout_nll", "grad_norm"):
        assert m[col].tolist() == pytest.approx(same[col].tolist(), rel=1e-6), col
    with pytest.raises(ValueError, match=r"other settings.*'eval_every': \(1, 2\)"):
        ex.run_grid(["nvfp4-lora"], [0], output_dir=tmp_path, log=lambda s: None, eval_every=2, **TINY)
    with pytest.raises(ValueError, match="eval_every must be an int >= 0"):
        ex.run_grid(["nvfp4-lora"], [0], output_dir=tmp_path / "x", log=lambda s: None, eval_every=-1, **TINY)


def test_views_table_and_plots(tiny_grid):
    import matplotlib.figure

    _, metrics, summary = tiny_grid
    table = ex.summary_table(summary)
    assert list(table.index) == ["NVFP4-LoRA", "bf16-LoRA"] and (table["seeds"] == 1).all()
    assert table.loc["bf16-LoRA", "lr"] == 1e-3 and math.isnan(table.loc["bf16-LoRA", "final_accuracy_sd"])
    md = ex.markdown_table(table)
    assert md.count("\n") == 3 and "| NVFP4-LoRA | 1 | 0.002 |" in md
    fig = ex.plot_curves(metrics)
    assert isinstance(fig, matplotlib.figure.Figure) and [a.get_title() for a in fig.axes] == ["reward", "entropy"]
    assert len(fig.axes[0].get_lines()) >= 2  # one line per configuration
    assert isinstance(ex.plot_curves(metrics, ("reward",), errorbar="sd", smooth=2), matplotlib.figure.Figure)
    assert len(ex.plot_summary(summary).axes) == 3
    with pytest.raises(ValueError, match="lacks"):
        ex.plot_curves(metrics, ("nope",))
    # a sparse metric (held-out accuracy at step 2 only) is drawn at its own steps and never smoothed
    sparse = metrics.assign(**{"eval/accuracy": metrics["step"].map({1: math.nan, 2: 0.75})})
    assert ex.curve_metrics(metrics) == ("reward", "entropy", "rollout_nll", "completions/mean_length")
    assert ex.curve_metrics(sparse)[-1] == "eval/accuracy"
    fig = ex.plot_curves(sparse, ("reward", "eval/accuracy"), smooth=5)
    assert [a.get_title() for a in fig.axes] == ["reward (5-step mean)", "eval/accuracy"]
    drawn = [line for line in fig.axes[1].get_lines() if len(line.get_xdata())]
    assert drawn and all(list(line.get_xdata()) == [2] and list(line.get_ydata()) == [0.75] for line in drawn)
    with pytest.raises(ValueError, match="empty"):
        ex.summary_table(summary.iloc[:0])


def test_summary_table_aggregates_over_seeds():
    rows = [dict(config="a", label="A", seed=s, lr=1e-3, initial_entropy=e, mean_entropy=e, initial_rollout_nll=e,
                 base_accuracy=0.25, final_accuracy=f, mean_reward=0.5, final_reward=0.9, wall_seconds=60.0)
            for s, e, f in [(0, 0.1, 0.8), (1, 0.3, 1.0)]]
    t = ex.summary_table(pd.DataFrame(rows))
    assert t.loc["A", "initial_entropy"] == pytest.approx(0.2)
    assert t.loc["A", "final_accuracy_sd"] == pytest.approx(math.sqrt(0.02))
    assert "0.2000 ± 0.1414" in ex.markdown_table(t)


def test_cli_reports_bad_input(capsys):
    with pytest.raises(SystemExit):
        ex.main(["--configs", "nope", "--out", "unused"])
    assert "unknown config 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.main(["--grid", "huge"])


def _grid_parallel(tmp_path, *args, **env):
    """scripts/grid_parallel.sh on the smoke grid, on the CPU, into tmp_path/grid: (OUT_DIR, the
    finished process), after checking that it exited 0."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "grid"
    env = {**os.environ, "PYTHON": sys.executable, "QERL_THREADS": "1", **env}
    done = subprocess.run(["bash", str(root / "scripts" / "grid_parallel.sh"), str(out), "smoke", "0",
                           "--device", "cpu", *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out, done


@pytest.mark.slow
def test_parallel_script_trains_one_process_per_config_then_merges(tmp_path):
    # scripts/grid_parallel.sh made the committed GPU grid; on the CPU the smoke grid's two configs
    out, done = _grid_parallel(tmp_path)
    assert "finished runs: 2; configurations not finished: 0" in done.stdout
    for name in ("nvfp4-lora", "bf16-lora"):
        assert (out / "parts" / name / "runs" / f"{name}_seed0_summary.csv").is_file()  # its own process
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(summary.config) == ["bf16-lora", "nvfp4-lora"]
    assert (out / "table.md").is_file() and (out / "command.json").is_file()
    assert "training" not in (out / "merge.log").read_text()  # the merge only read the runs back


@pytest.mark.slow
def test_parallel_script_splits_seeds_over_processes_with_seed_groups(tmp_path):
    # SEED_GROUPS="0 1": each configuration's two seeds train in two processes, one seed each
    out, done = _grid_parallel(tmp_path, "--seeds", "0", "1", SEED_GROUPS="0 1")
    assert "finished runs: 4; configurations not finished: 0" in done.stdout
    for name in ("nvfp4-lora", "bf16-lora"):
        for seed in (0, 1):
            runs = out / "parts" / f"{name}-s{seed}" / "runs"
            assert sorted(p.name for p in runs.glob("*_summary.csv")) == [f"{name}_seed{seed}_summary.csv"]
    summary = pd.read_csv(out / "summary.csv")
    assert sorted(zip(summary.config, summary.seed)) == [("bf16-lora", 0), ("bf16-lora", 1),
                                                        ("nvfp4-lora", 0), ("nvfp4-lora", 1)]
    assert "training" not in (out / "merge.log").read_text()


@pytest.mark.slow
def test_parallel_script_trains_and_merges_only_grid_configs(tmp_path):
    # GRID_CONFIGS="nvfp4-lora": a longer run of a subset; the other configuration never trains,
    # and the merge writes a grid of that subset alone (it would refuse a missing run otherwise)
    out, done = _grid_parallel(tmp_path, GRID_CONFIGS="nvfp4-lora")
    assert "finished runs: 1; configurations not finished: 0" in done.stdout
    assert sorted(p.name for p in (out / "parts").iterdir() if p.is_dir()) == ["nvfp4-lora"]
    assert sorted(pd.read_csv(out / "summary.csv").config) == ["nvfp4-lora"]
    assert json.loads((out / "command.json").read_text())["resolved"]["configs"] == ["nvfp4-lora"]


# ---- never destroy a user's files ---------------------------------------------------------------
def _fake_run_one(trained):
    """A stand-in for ``run_one`` that trains nothing: (rows, summary) shaped like the real ones."""
    def fake(gc, seed, cfg, data, device, base_cache, progress="none", eval_every=0):
        trained.append((gc.name, seed))
        rows = [{"config": gc.name, "label": gc.label, "seed": seed, "step": s,
                 **{m: 0.5 if m != "aqn/sigma" else 0.0 for m in ex.METRIC_COLUMNS}} for s in (1, 2)]
        summary = {"config": gc.name, "label": gc.label, "seed": seed, "format": gc.format, "aqn": gc.aqn,
                   "lr": gc.lr, "steps": cfg.total_steps, "batch_size": cfg.rollout.batch_size,
                   "group_size": cfg.rollout.group_size, "eval_size": cfg.data.eval_size,
                   "max_new_tokens": cfg.rollout.max_new_tokens, "eval_every": eval_every,
                   "model": cfg.model.name, "dataset": cfg.data.dataset, "base_accuracy": 0.25, "final_accuracy": 0.5,
                   "initial_entropy": 0.5, "mean_entropy": 0.5, "initial_rollout_nll": 0.5,
                   "mean_rollout_nll": 0.5, "initial_reward": 0.5, "mean_reward": 0.5, "final_reward": 0.5,
                   "wall_seconds": 1.0, "seconds_per_step": 0.5, "device": "cpu", "threads": 1, "torch": "x"}
        return rows, summary
    return fake


def _files(path):
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _refused():
    from qerl_kit.export import RefusedToOverwrite

    return RefusedToOverwrite


def test_grid_into_a_foreign_non_empty_dir_is_refused_and_its_files_are_intact(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(ex, "run_one", _fake_run_one(trained))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "summary.csv").write_text("mine,not yours\n")
    before = _files(out)
    with pytest.raises(_refused()) as err:
        ex.run_grid(["nvfp4-lora"], [0], output_dir=out, log=lambda s: None, **TINY)
    assert str(out) in str(err.value) and "notes.txt" in str(err.value)
    assert trained == [] and _files(out) == before
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "summary.csv"]  # no runs/, no marker
    with pytest.raises(SystemExit) as exit_:  # the command line: a usage error (2), not a traceback
        ex.main(["--grid", "smoke", "--device", "cpu", "--out", str(out)])
    assert exit_.value.code == 2 and _files(out) == before and trained == []


def test_grid_refuses_the_committed_results_dir(tmp_path, monkeypatch):
    """The committed results (bench/results/experiments_cpu, no runs/ in git) are not a grid to resume:
    a copy of them is refused, and the real one is under bench/results/, which needs allow_results=True
    (so is anything under lab/results/)."""
    import shutil

    trained = []
    monkeypatch.setattr(ex, "run_one", _fake_run_one(trained))
    root = Path(__file__).resolve().parents[1]
    committed = root / "bench" / "results" / "experiments_cpu"
    assert (committed / "summary.csv").is_file()  # the grid this test guards is where the docs cite it
    copy = tmp_path / "experiments"
    shutil.copytree(committed, copy)
    before = _files(copy)
    with pytest.raises(_refused(), match=r"no \.qerl_grid\.json, and no runs/"):
        ex.run_grid(["nvfp4-lora"], [0], output_dir=copy, log=lambda s: None, **TINY)
    assert _files(copy) == before
    committed_before = _files(committed)
    targets = (committed, committed / "new-grid", root / "bench" / "results", root / "lab" / "results" / "new-grid")
    try:
        for target in targets:
            with pytest.raises(_refused(), match="committed results"):
                ex.run_grid(["nvfp4-lora"], [0], output_dir=target, log=lambda s: None, **TINY)
        with pytest.raises(SystemExit):
            ex.main(["--grid", "smoke", "--device", "cpu", "--out", str(committed)])
        assert not any(t.name == "new-grid" and t.exists() for t in targets)
        assert not (committed / "runs").exists() and not (committed / ".qerl_grid.json").exists()
    finally:  # should the guard ever fail, leave no grid in the checkout
        for target in targets:
            if target.name == "new-grid":
                shutil.rmtree(target, ignore_errors=True)
    assert _files(committed) == committed_before and trained == []


def test_grid_writes_a_marker_and_resumes_after_a_crash(tmp_path, monkeypatch):
    trained = []
    fake = _fake_run_one(trained)

    def crash_on_second(gc, seed, *args, **kwargs):
        if len(trained) == 1:
            raise RuntimeError("killed")
        return fake(gc, seed, *args, **kwargs)

    out = tmp_path / "grid"
    monkeypatch.setattr(ex, "run_one", crash_on_second)
    with pytest.raises(RuntimeError, match="killed"):
        ex.run_grid(["nvfp4-lora", "bf16-lora"], [0], output_dir=out, log=lambda s: None, **TINY)
    marker = json.loads((out / ".qerl_grid.json").read_text())
    assert marker["version"] == 1
    assert {"runs/nvfp4-lora_seed0_metrics.csv", "runs/nvfp4-lora_seed0_summary.csv"} <= set(marker["files"])
    (out / "notes.txt").write_text("mine")  # a file of the user's in a grid of ours is left alone
    monkeypatch.setattr(ex, "run_one", fake)
    metrics, summary = ex.run_grid(["nvfp4-lora", "bf16-lora"], [0], output_dir=out, log=lambda s: None, **TINY)
    assert trained == [("nvfp4-lora", 0), ("bf16-lora", 0)] and len(summary) == 2
    assert (out / "notes.txt").read_text() == "mine"
    assert {"metrics.csv", "summary.csv", "runs/bf16-lora_seed0_summary.csv"} <= set(
        json.loads((out / ".qerl_grid.json").read_text())["files"])
    # a file of the user's where the grid would write: refused, not overwritten
    (out / "runs" / "bf16-lora_seed1_metrics.csv").write_text("mine")
    with pytest.raises(_refused(), match="bf16-lora_seed1_metrics.csv"):
        ex.run_grid(["bf16-lora"], [1], output_dir=out, log=lambda s: None, **TINY)
    assert (out / "runs" / "bf16-lora_seed1_metrics.csv").read_text() == "mine"


def test_cli_writes_its_files_into_the_grid_and_runs_again(tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(ex, "run_one", _fake_run_one(trained))
    out = tmp_path / "grid"
    args = ["--grid", "smoke", "--device", "cpu", "--eval-size", "4", "--out", str(out)]
    assert ex.main(args) == 0
    files = set(json.loads((out / ".qerl_grid.json").read_text())["files"])
    assert {"curves.png", "curves_smoothed.png", "summary.png", "table.md", "command.json", "metrics.csv",
            "summary.csv"} <= files
    assert ex.main(args) == 0 and len(trained) == 2  # the second call reads the runs back
    (out / "table.md").unlink()
    (out / "table.md").mkdir()  # something that is not ours where the table goes
    with pytest.raises(SystemExit):
        ex.main(args)


def test_grid_made_before_the_marker_and_the_parallel_merge_dir_still_resume(tmp_path, monkeypatch):
    """A grid directory without .qerl_grid.json (made before it existed, or scripts/grid_parallel.sh's
    OUT_DIR: runs/ with copied run CSVs, parts/, logs) is recognised by its layout and resumed."""
    import shutil

    trained = []
    monkeypatch.setattr(ex, "run_one", _fake_run_one(trained))
    part = tmp_path / "out" / "parts" / "nvfp4-lora"
    ex.run_grid(["nvfp4-lora"], [0], output_dir=part, log=lambda s: None, **TINY)
    out = tmp_path / "out"
    (out / "runs").mkdir()
    for csv in (part / "runs").glob("*.csv"):
        shutil.copy(csv, out / "runs")
    (out / "parts" / "nvfp4-lora.log").write_text("log")
    (out / "merge.log").write_text("")
    metrics, summary = ex.run_grid(["nvfp4-lora"], [0], output_dir=out, log=lambda s: None, **TINY)
    assert trained == [("nvfp4-lora", 0)] and len(summary) == 1  # read back, not trained again
    assert (out / ".qerl_grid.json").is_file() and (out / "summary.csv").is_file()
    legacy = tmp_path / "legacy"
    shutil.copytree(part, legacy)
    (legacy / ".qerl_grid.json").unlink()  # as made by an older qerl_kit
    ex.run_grid(["nvfp4-lora", "bf16-lora"], [0], output_dir=legacy, log=lambda s: None, **TINY)
    assert trained == [("nvfp4-lora", 0), ("bf16-lora", 0)]


def test_the_cli_gives_each_task_its_own_completion_budget():
    from qerl_kit.experiments import _task_budget

    assert _task_budget("countdown") == 96  # the task's own (qerl_kit.tasks.registry)
    assert _task_budget("arith") == 64
    assert _task_budget("my_problems.jsonl") == 512


def test_cli_lr_sets_the_grids_learning_rates(tmp_path, monkeypatch):
    seen = {}

    def fake_run_grid(configs, seeds, **kw):  # what the CLI hands the grid, without training
        seen.clear()
        seen.update({c.name: c.lr for c in ex.resolve_configs(configs, ex.PAPER_LR)})
        raise ValueError("stop here")

    monkeypatch.setattr(ex, "run_grid", fake_run_grid)
    with pytest.raises(SystemExit):
        ex.main(["--grid", "smoke", "--lr", "4e-4", "--out", str(tmp_path / "g")])
    assert seen == {"nvfp4-lora": 4e-4, "bf16-lora": 4e-4 * ex.BF16_LR_RATIO}
    with pytest.raises(SystemExit):  # no --lr: names, so run_grid keeps its rule (a local model: the paper's lr)
        ex.main(["--grid", "smoke", "--model", "some/dir", "--out", str(tmp_path / "p")])
    assert seen == {"nvfp4-lora": ex.PAPER_LR, "bf16-lora": ex.PAPER_LR * ex.BF16_LR_RATIO}
    with pytest.raises(SystemExit):
        ex.main(["--grid", "smoke", "--lr", "-1", "--out", str(tmp_path / "h")])


def test_cli_eval_every_reaches_the_grid(tmp_path, monkeypatch):
    seen = []

    def fake_run_grid(configs, seeds, **kw):  # what the CLI hands the grid, without training
        seen.append(kw["eval_every"])
        raise ValueError("stop here")

    monkeypatch.setattr(ex, "run_grid", fake_run_grid)
    for argv, want in ((["--eval-every", "25"], 25), ([], ex.GRIDS["smoke"][1].eval_every)):
        with pytest.raises(SystemExit):
            ex.main(["--grid", "smoke", "--out", str(tmp_path / f"g{want}"), *argv])
    assert seen == [25, 0]


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu"])
def test_grid_refuses_a_device_that_is_not_one_as_a_usage_error(tmp_path, monkeypatch, capsys, device):
    """``--device gpu`` is a one-line usage error (rc 2) naming the value and what is allowed, before
    anything trains or is written; it was torch's traceback from inside main()."""
    trained = []
    monkeypatch.setattr(ex, "run_one", _fake_run_one(trained))
    with pytest.raises(SystemExit) as exit_:
        ex.main(["--grid", "smoke", "--device", device, "--out", str(tmp_path / "grid")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and trained == [] and not (tmp_path / "grid").exists()
    assert repr(device) in err and "auto, cpu or cuda" in err and "Traceback" not in err
