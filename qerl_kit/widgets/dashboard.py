"""Training dashboard: run a Trainer in chunks with live plots, sliders and a stop button.

Sliders (learning rate, AQN sigma_start, temperature) are applied to the trainer between chunks
(``apply_controls``); the stop button sets ``trainer.stop_requested`` so the running chunk ends
after its current step. Jupyter handles widget events only between cell executions, so a chunk
started from the "run" button trains in a background thread and the notebook stays live; a
chunk started from code (``dash.run(steps)``) trains in the foreground, as papermill needs.
"""

from __future__ import annotations

import threading
import time

from qerl_kit.plots import DEFAULT_METRICS, plot_metrics
from qerl_kit.table import html_table
from qerl_kit.widgets.common import HAS_WIDGETS, W, figure_html, show

_TABLE_COLUMNS = ("step", "reward", "accuracy", "entropy", "completions/mean_length", "aqn/sigma", "lr",
                  "time/step")


class TrainingDashboard:
    def __init__(self, trainer, metrics=DEFAULT_METRICS, redraw_every_s: float = 1.0):
        self.trainer, self.metrics = trainer, tuple(metrics)
        self.redraw_every_s = redraw_every_s
        self._last_draw = 0.0
        self._thread: threading.Thread | None = None
        self.widget = self._build() if HAS_WIDGETS else None

    # -- controls -------------------------------------------------------------------------------
    def apply_controls(self, lr: float | None = None, sigma_start: float | None = None,
                       temperature: float | None = None) -> None:
        """Push control values into the trainer (between chunks)."""
        t = self.trainer
        if lr is not None:
            t.set_lr(lr)
        if sigma_start is not None and t.aqn is not None:
            t.aqn.sigma_start = sigma_start
        if temperature is not None and temperature != t.config.rollout.temperature:
            t.config = t.config.replace(rollout={"temperature": temperature})

    def run(self, steps: int, background: bool = False):
        """Train ``steps`` more steps, updating the views after each step."""
        if self.widget is not None:
            self.apply_controls(self.lr.value, self.sigma.value if self.trainer.aqn else None, self.temp.value)
            self.progress.max, self.progress.value = steps, 0
        if background:
            self._thread = threading.Thread(target=self._train, args=(steps,), daemon=True)
            self._thread.start()
            return self._thread
        self._train(steps)
        return self.trainer

    def stop(self) -> None:
        self.trainer.stop_requested = True

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _train(self, steps: int) -> None:
        self.trainer.train(steps, callback=self._on_step)
        self._draw(force=True)

    def _on_step(self, row: dict) -> None:
        if self.widget is not None:
            self.progress.value += 1
        self._draw()

    # -- views ----------------------------------------------------------------------------------
    def table_html(self, last: int = 8) -> str:
        rows = [{c: r.get(c, "") for c in _TABLE_COLUMNS} for r in self.trainer.history[-last:]]
        return html_table(rows, caption=f"last {len(rows)} steps")

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.trainer.history or (not force and now - self._last_draw < self.redraw_every_s):
            return
        self._last_draw = now
        fig = plot_metrics(self.trainer.history, self.metrics)
        if self.widget is not None:
            self.plot.value = figure_html(fig)
            self.table.value = self.table_html()
        else:
            import matplotlib.pyplot as plt

            plt.close(fig)

    def _build(self):
        t = self.trainer
        lr = t.optimizer.param_groups[0].get("initial_lr", t.optimizer.param_groups[0]["lr"])
        self.lr = W.FloatLogSlider(value=lr, base=10, min=-6, max=-1, step=0.01, description="lr",
                                  readout_format=".1e")
        sigma = t.aqn.sigma_start if t.aqn else 1e-2
        self.sigma = W.FloatLogSlider(value=sigma, base=10, min=-4, max=-0.5, step=0.01, description="AQN sigma",
                                      readout_format=".1e", disabled=t.aqn is None)
        self.temp = W.FloatSlider(value=t.config.rollout.temperature, min=0.1, max=2.0, step=0.05,
                                  description="temperature")
        self.steps = W.IntText(value=10, description="steps")
        self.run_button = W.Button(description="run chunk", icon="play")
        self.stop_button = W.Button(description="stop", icon="stop")
        self.run_button.on_click(lambda _b: self.run(self.steps.value, background=True))
        self.stop_button.on_click(lambda _b: self.stop())
        self.progress = W.IntProgress(value=0, min=0, max=1, description="chunk")
        self.plot, self.table = W.HTML(), W.HTML()
        return W.VBox([W.HBox([self.lr, self.sigma, self.temp]),
                       W.HBox([self.steps, self.run_button, self.stop_button, self.progress]),
                       self.plot, self.table])

    def _ipython_display_(self):
        if self.widget is not None:
            self._draw(force=True)
            show(self.widget)
        else:
            print(f"TrainingDashboard: {len(self.trainer.history)} steps so far (ipywidgets not installed)")
            if self.trainer.history:
                show(plot_metrics(self.trainer.history, self.metrics))
