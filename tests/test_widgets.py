"""Widgets are a view layer: they observe and poke library objects and work without ipywidgets."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from qerl_kit.aqn import AQN
from qerl_kit.config import TrainConfig
from qerl_kit.plots import plot_metrics, plot_schedule

pytest.importorskip("ipywidgets")


def test_aqn_panel_sliders_redraw_readout_and_plot_and_write_through():
    from qerl_kit.widgets import AQNPanel

    aqn = AQN(total_steps=100)
    panel = AQNPanel(aqn)
    label, plot = panel.label.value, panel.plot.value
    assert "sigma = " in label and plot.startswith("<img")
    panel.s_start.value = 0.05
    assert aqn.sigma_start == pytest.approx(0.05)  # written into the AQN the trainer uses
    assert panel.label.value != label and panel.plot.value != plot
    label = panel.label.value
    panel.s_step.value = 5  # stage 0: noise-free
    assert "sigma = 0.000e+00" in panel.label.value and panel.label.value != label
    panel.s_stages.value = 20
    assert aqn.stages == 20


def test_aqn_panel_probe_records_results():
    from qerl_kit.widgets import AQNPanel

    panel = AQNPanel(AQN(total_steps=100), probe=lambda s: {"entropy": 1 + s, "distinct": 0.5})
    panel._probe_now()
    assert panel.probe_results[-1]["entropy"] == pytest.approx(1 + panel.aqn.sigma(50))
    assert "<table>" in panel.probe_out.value


def test_aqn_panel_rejects_impossible_values_without_changing_the_aqn():
    from qerl_kit.widgets import AQNPanel

    panel = AQNPanel(AQN(total_steps=10, stages=10))
    panel.s_stages.value = 12  # more stages than steps
    assert panel.aqn.stages == 10 and "at least the number of stages" in panel.label.value


class _FakeTrainer:
    def __init__(self):
        self.history, self.stop_requested = [], False
        self.config = TrainConfig()
        self.aqn = AQN(total_steps=100)
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 1e-5, "initial_lr": 1e-5}])
        self.lrs = []

    def set_lr(self, lr):
        self.lrs.append(lr)

    def train(self, steps, callback=None):
        for _ in range(steps):
            if self.stop_requested:
                break
            row = {"step": len(self.history) + 1, "reward": 0.1 * len(self.history), "accuracy": 0.5,
                   "entropy": 1.0, "completions/mean_length": 10, "clip_ratio/region_mean": 0.0}
            self.history.append(row)
            callback(row)
        return self


def test_dashboard_applies_controls_between_chunks_and_draws():
    from qerl_kit.widgets import TrainingDashboard

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    dash.lr.value, dash.sigma.value, dash.temp.value = 3e-4, 0.02, 0.7
    dash.run(3)
    assert trainer.lrs == [pytest.approx(3e-4)] and trainer.aqn.sigma_start == pytest.approx(0.02)
    assert trainer.config.rollout.temperature == pytest.approx(0.7)
    assert len(trainer.history) == 3 and dash.progress.value == 3
    assert dash.plot.value.startswith("<img") and "<table>" in dash.table.value
    dash.stop()
    dash.run(2)
    assert len(trainer.history) == 3  # stop requested: no more steps in this chunk


def test_dashboard_background_chunk_stops_cleanly():
    from qerl_kit.widgets import TrainingDashboard

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    dash.run(5, background=True)
    dash.wait()
    assert len(trainer.history) == 5


def test_plots_return_figures():
    fig = plot_schedule(AQN(total_steps=50), step=20)
    assert fig.axes[0].get_ylabel() == "AQN sigma"
    fig = plot_metrics([{"step": i, "reward": i, "entropy": 1.0} for i in range(1, 8)])
    assert [ax.get_title() for ax in fig.axes] == ["reward", "entropy"]


def test_everything_works_without_ipywidgets():
    code = (
        "import sys; sys.modules['ipywidgets'] = None\n"
        "from qerl_kit.widgets import AQNPanel, HAS_WIDGETS\n"
        "from qerl_kit.aqn import AQN\n"
        "assert not HAS_WIDGETS\n"
        "p = AQNPanel(AQN(total_steps=20)); assert p.widget is None\n"
        "p._ipython_display_()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sigma = " in out.stdout
