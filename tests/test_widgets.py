"""Widgets are a view layer: they observe and poke library objects and work without ipywidgets."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from qerl_kit.aqn import AQN
from qerl_kit.config import TrainConfig
from qerl_kit.plots import plot_dashboard, plot_metrics, plot_schedule

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


class _RecordingProbe:
    """A fake probe: records every sigma it is called with; entropy grows with sigma."""

    def __init__(self, offset=0.0):
        self.sigmas, self.offset = [], offset

    def __call__(self, sigma):
        self.sigmas.append(sigma)
        return {"entropy": 1.0 + sigma + self.offset, "distinct": 0.5}


def test_aqn_panel_sigma_sliders_are_wide_readable_grids_reaching_past_the_tiny_models_break():
    from qerl_kit.widgets import AQNPanel
    from qerl_kit.widgets.aqn_panel import SIGMA_START_GRID

    panel = AQNPanel(AQN(total_steps=100))
    starts = [v for _label, v in panel.s_start.options]
    assert starts == sorted(starts) and starts[0] == 1e-4 and starts[-1] == 3.0 == SIGMA_START_GRID[-1]
    assert {0.5, 0.7, 1.0, 1.5, 2.0} <= set(starts)  # where the shipped tiny model's accuracy breaks
    assert [label for label, _v in panel.s_start.options][:3] == ["1.0e-04", "2.0e-04", "5.0e-04"]
    assert panel.s_start.value == 1e-2 and panel.s_end.value == 5e-4  # the AQN defaults are on the grids
    assert int(panel.s_start.layout.width.rstrip("px")) >= 420 and panel.s_start.readout
    panel.s_start.value = 2.0  # a grid value, written through exactly
    assert panel.aqn.sigma_start == 2.0 and "2.0e+00" in panel.label.value
    off = AQNPanel(AQN(sigma_start=3e-2, total_steps=100))  # an off-grid value is added, not snapped
    assert off.s_start.value == 3e-2 and off.aqn.sigma_start == 3e-2


def test_aqn_panel_measures_at_the_sigma_start_slider_and_says_so():
    from qerl_kit.widgets import AQNPanel

    probe = _RecordingProbe()
    panel = AQNPanel(AQN(total_steps=100), probe=probe)
    assert panel.probe_button.description == "measure at sigma_start = 1.0e-02"
    panel.s_start.value = 1.0
    assert panel.probe_button.description == "measure at sigma_start = 1.0e+00"
    panel.s_step.value = 5  # the step marker moves the readout, not what is measured
    panel.probe_button.click()
    assert probe.sigmas == [0.0, 1.0]  # the sigma-0 reference row first, then the slider's sigma
    assert panel.probe_results[-1]["sigma"] == 1.0 and panel.probe_results[-1]["entropy"] == pytest.approx(2.0)
    panel.s_start.value = 0.5
    panel.probe_button.click()
    assert probe.sigmas == [0.0, 1.0, 0.5]  # references are measured once


def test_aqn_panel_table_shows_labelled_reference_rows_first():
    from qerl_kit.widgets import AQNPanel

    probe, dense = _RecordingProbe(), _RecordingProbe(offset=-0.5)
    panel = AQNPanel(AQN(total_steps=100), probe=probe, reference_probe=dense)
    panel.s_start.value = 1.0
    panel.measure()
    assert dense.sigmas == [0.0] and probe.sigmas == [0.0, 1.0]
    refs = panel.reference_results
    assert [r["model"] for r in refs] == ["quantized, no AQN (reference)", "dense bf16 (reference)"]
    assert [r["entropy"] for r in refs] == [1.0, 0.5] and all(r["sigma"] == 0.0 for r in refs)
    table = panel.probe_out.value
    rows = table.split("<tr>")[2:]  # after the header row
    assert len(rows) == 3 and "no AQN (reference)" in rows[0] and "dense bf16" in rows[1]
    assert "quantized + AQN" in rows[2] and "1.00e+00" in rows[2]
    no_ref = AQNPanel(AQN(total_steps=100), probe=_RecordingProbe())
    no_ref.measure()
    assert [r["model"] for r in no_ref.reference_results] == ["quantized, no AQN (reference)"]


def test_aqn_panel_refuses_sigma_start_below_sigma_end_visibly():
    from qerl_kit.widgets import AQNPanel

    panel = AQNPanel(AQN(sigma_start=1e-2, sigma_end=5e-4, total_steps=100))
    panel.s_start.value = 2e-4  # below sigma_end
    assert panel.aqn.sigma_start == 1e-2 and panel.aqn.sigma_end == 5e-4  # unchanged
    err = panel.label.value
    assert "color:#b00" in err and "sigma_start" in err and "sigma_end" in err
    assert "0.0002" in err and "0.0005" in err, err  # both values named
    panel.s_start.value = 1e-3  # a valid value again: applied, the readout is back
    assert panel.aqn.sigma_start == 1e-3 and "sigma = " in panel.label.value


class _FakeTrainer:
    """The Trainer surface the dashboard uses; ``gate`` (an Event) holds every step until it is set,
    ``fail_at`` raises at that step, ``on_step_start(step)`` is called as each step begins."""

    def __init__(self, gate=None, fail_at=None):
        self.history, self.stop_requested, self.step = [], False, 0
        self.config = TrainConfig()
        self.aqn = AQN(total_steps=100)
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 1e-5, "initial_lr": 1e-5}])
        self.lrs, self.gate, self.fail_at, self.on_step_start = [], gate, fail_at, None

    def set_lr(self, lr):
        self.lrs.append(lr)
        self.optimizer.param_groups[0].update(lr=lr, initial_lr=lr)

    def train(self, steps, callback=None):
        for _ in range(steps):
            if self.stop_requested:
                break
            if self.gate is not None:
                assert self.gate.wait(10)
            if self.on_step_start is not None:
                self.on_step_start(self.step + 1)
            if self.fail_at == self.step + 1:
                raise RuntimeError("boom")
            self.step += 1
            row = {"step": self.step, "reward": 0.1 * self.step, "accuracy": 0.5, "entropy": 1.0,
                   "completions/mean_length": 10, "clip_ratio/region_mean": 0.0,
                   "aqn/sigma": self.aqn.sigma(self.step), "rollout/temperature": self.config.rollout.temperature}
            self.history.append(row)
            callback(row)
        self.stop_requested = False  # as the Trainer does
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
    assert dash.plot.value.startswith("<img") and "max-width:100%" in dash.plot.value
    assert "<table>" in dash.table.value


def test_dashboard_run_button_is_disabled_while_a_background_chunk_runs():
    import threading

    from qerl_kit.widgets import TrainingDashboard

    gate = threading.Event()
    trainer = _FakeTrainer(gate=gate)
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    assert not dash.run_button.disabled and dash.status == "idle"
    thread = dash.run(3, background=True)
    assert dash.run_button.disabled and dash.running and dash.status == "running chunk: 0/3"
    with pytest.raises(RuntimeError, match="already running"):
        dash.run(1)
    gate.set()
    dash.wait()
    assert not thread.is_alive() and not dash.run_button.disabled and not dash.running
    assert len(trainer.history) == 3 and "idle: chunk of 3 steps done" in dash.status
    assert "idle" in dash.status_label.value


def test_dashboard_run_button_comes_back_after_an_exception():
    from qerl_kit.widgets import TrainingDashboard

    trainer = _FakeTrainer(fail_at=2)
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    with pytest.raises(RuntimeError, match="boom"):
        dash.run(4)
    assert not dash.run_button.disabled and not dash.running
    assert dash.status.startswith("failed after 1 steps: RuntimeError: boom")
    trainer.fail_at = None
    dash.run(2)  # the dashboard is usable again
    assert trainer.step == 3


def test_dashboard_stop_while_idle_is_a_no_op_and_a_stale_flag_does_not_block_a_chunk():
    from qerl_kit.widgets import TrainingDashboard

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    assert dash.stop() is False and trainer.stop_requested is False
    assert "stop ignored" in dash.status
    dash.run(2)
    assert trainer.step == 2
    trainer.stop_requested = True  # stale flag, e.g. set by other code between chunks
    dash.run(2)
    assert trainer.step == 4 and "chunk of 2 steps done" in dash.status
    # a stop pressed during a chunk (here: while step 7 runs) ends it after the step in progress
    trainer.on_step_start = lambda step: dash.stop() if step == 7 else None
    dash.run(10, background=True)
    dash.wait()
    assert trainer.step == 7 and dash.status.startswith("stopped after 3 steps of 10")
    assert dash.progress.value == 3 and trainer.stop_requested is False


def test_dashboard_status_counts_steps_of_the_running_chunk():
    from qerl_kit.widgets import TrainingDashboard

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    seen = []
    original = dash._on_step

    def spy(row):
        original(row)
        seen.append(dash.status)

    dash._on_step = spy
    dash.run(3)
    assert seen == ["running chunk: 1/3", "running chunk: 2/3", "running chunk: 3/3"]


def test_dashboard_live_values_show_what_the_trainer_uses():
    from qerl_kit.widgets import TrainingDashboard

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    assert "lr = 1.00e-05" in dash.live_label.value and "temperature = 1.00" in dash.live_label.value
    dash.apply_controls(lr=1e-3, sigma_start=0.05, temperature=1.5)
    assert dash.live_values() == {"lr": 1e-3, "sigma_start": 0.05, "temperature": 1.5}
    assert ("lr = 1.00e-03" in dash.live_label.value and "AQN sigma_start = 5.0e-02" in dash.live_label.value
            and "temperature = 1.50" in dash.live_label.value)
    trainer.optimizer.param_groups[0]["lr"] = 7e-4  # e.g. the lr schedule moved it during a step
    dash._on_step({"step": 1})
    assert "lr = 7.00e-04" in dash.live_label.value  # refreshed after each step, from the optimizer


def test_dashboard_live_values_follow_a_real_trainer(tmp_path):
    from qerl_kit.widgets import TrainingDashboard
    from tests.test_trainer import _trainer

    trainer = _trainer(tmp_path)
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    dash.lr.value, dash.temp.value = 1e-3, 1.5
    dash.run(1)
    v = dash.live_values()
    assert v["lr"] == pytest.approx(trainer.optimizer.param_groups[0]["lr"]) and v["temperature"] == 1.5
    assert trainer.history[-1]["rollout/temperature"] == 1.5 and "aqn/sigma" in trainer.history[-1]
    assert f"lr = {v['lr']:.2e}" in dash.live_label.value


def test_dashboard_figure_is_two_rows_900px_with_legend_integer_ticks_and_chunk_lines():
    from matplotlib.ticker import MaxNLocator

    from qerl_kit.widgets import TrainingDashboard
    from qerl_kit.widgets.common import WIDGET_DPI

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    dash.run(4)
    dash.temp.value = 1.5
    dash.run(3)
    assert dash.chunk_starts == [1, 5]
    fig = dash.figure()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["reward", "accuracy", "entropy", "completions/mean_length",
                                                "aqn/sigma", "rollout/temperature"]
    rows = {round(ax.get_position().y0, 3) for ax in axes}
    assert len(rows) == 2  # two rows of three
    assert fig.get_size_inches()[0] * WIDGET_DPI == pytest.approx(900)
    _handles, labels = axes[0].get_legend_handles_labels()
    assert "mean of last 5" in labels and "chunk start" in labels and axes[0].get_legend() is not None
    assert isinstance(axes[0].xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in axes[0].get_xticks())
    vlines = [ln for ln in axes[0].lines if ln.get_label() == "chunk start"]
    assert len(vlines) == 1 and vlines[0].get_xdata()[0] == 4.5  # between the chunks (step 1 is none)
    temp = axes[5].lines[0].get_ydata()
    assert list(temp) == [1.0] * 4 + [1.5] * 3  # temperature plotted per step


def test_widget_images_are_palette_pngs_that_fit_the_output_width():
    import io

    from PIL import Image

    from qerl_kit.widgets.common import figure_html, figure_png

    png = figure_png(plot_schedule(AQN(total_steps=50), step=20))
    assert Image.open(io.BytesIO(png)).mode == "P"  # 64 colours: small widget state in saved notebooks
    assert 'style="max-width:100%;height:auto"' in figure_html(plot_schedule(AQN(total_steps=50)))


def test_plots_return_figures():
    fig = plot_schedule(AQN(total_steps=50), step=20)
    assert fig.axes[0].get_ylabel() == "AQN sigma"
    fig = plot_metrics([{"step": i, "reward": i, "entropy": 1.0} for i in range(1, 8)])
    assert [ax.get_title() for ax in fig.axes] == ["reward", "entropy"]  # one row, unchanged for its callers
    fig = plot_dashboard([{"step": i, "reward": i} for i in range(1, 4)])
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "entropy\nnot logged" in texts and len(fig.axes) == 6  # a missing metric keeps its panel


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
