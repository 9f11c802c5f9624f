"""Training dashboard: run a Trainer in chunks with live plots, sliders and a stop button.

A control and the trainer value it edits never disagree. A slider moved by hand is applied to the
trainer at once (``apply_controls``; while a chunk runs, at the chunk's end, so a step never changes
temperature halfway). A value changed from code (``trainer.set_lr(1e-3)``, ``trainer.aqn.sigma_start
= ...``) is read back into the sliders (``sync_controls``) when the dashboard is shown, when a chunk
starts and after every step: a chunk never trains at a stale slider value. The stop button sets ``trainer.stop_requested`` so the running chunk ends
after its current step (pressed while no chunk runs, it does nothing). Jupyter handles widget
events only between cell executions, so a chunk started from the "run" button trains in a
background thread and the notebook stays live (the button is disabled until the chunk ends); a
chunk started from code (``dash.run(steps)``) trains in the foreground, as papermill needs.
"""

from __future__ import annotations

import html
import math
import threading
import time

from qerl_kit.config_types import check_lr, check_names, check_steps, check_value
from qerl_kit.plots import DASHBOARD_METRICS, TRAINER_METRICS, plot_dashboard
from qerl_kit.table import html_table
from qerl_kit.widgets.aqn_panel import SIGMA_START_GRID, sigma_options
from qerl_kit.widgets.common import HAS_WIDGETS, W, figure_html, show

_TABLE_COLUMNS = ("step", "reward", "accuracy", "entropy", "completions/mean_length", "aqn/sigma", "lr",
                  "rollout/temperature", "time/step")


def check_metrics(metrics, trainer=None) -> tuple[str, ...]:
    """The dashboard's panels: a list of metric names the trainer logs (``plots.TRAINER_METRICS``, a
    ``family/*`` entry matching any name under it, or a column already in ``trainer.history``). One
    string is one name, never split into letters; an unknown name (``rewrd``) is a ``ConfigError``
    listing the known names with the nearest, not an empty panel."""
    logged = {k for row in getattr(trainer, "history", None) or () for k in row if isinstance(k, str)}

    def matches(name: str, known: str) -> bool:
        return name == known or (known.endswith("/*") and name.startswith(known[:-1]) and len(name) > len(known) - 1)

    return check_names("metrics", metrics, set(TRAINER_METRICS) | logged, matches, what="metric", empty=False)


class TrainingDashboard:
    def __init__(self, trainer, metrics=DASHBOARD_METRICS, redraw_every_s: float = 1.0):
        self.trainer, self.metrics = trainer, check_metrics(metrics, trainer)
        # seconds between redraws while training (0 = after every step); NaN would never redraw
        self.redraw_every_s = check_value("redraw_every_s", redraw_every_s, float, ge=0,
                                          why="seconds between plot redraws while a chunk trains; 0 = every step")
        self._last_draw = 0.0
        self._thread: threading.Thread | None = None
        self.running = False            # a chunk is training (set before its thread starts)
        self.chunk_starts: list[int] = []  # the first step of every chunk, for the plot's boundaries
        self.status = "idle"
        self._chunk_steps, self._chunk_done = 0, 0
        self._syncing, self._pending = False, set()  # a sync from the trainer / a hand change waiting for a chunk's end
        self.widget = self._build() if HAS_WIDGETS else None
        self._show_live()

    # -- controls -------------------------------------------------------------------------------
    def apply_controls(self, lr: float | None = None, sigma_start: float | None = None,
                       temperature: float | None = None) -> None:
        """Push control values into the trainer (between chunks). All are checked first, by the rules
        the trainer and its AQN use (a sigma_start below the AQN's sigma_end, noise that would grow, is
        refused unless the run allows it): a refused value raises and changes nothing, and the sliders
        snap back to the trainer's values."""
        t = self.trainer
        try:
            if lr is not None:
                lr = check_lr("lr", lr)
            if sigma_start is not None and t.aqn is not None:
                t.aqn.checked(sigma_start=sigma_start)
            config = t.config
            if temperature is not None and temperature != t.config.rollout.temperature:
                config = t.config.replace(rollout={"temperature": temperature})
        except ValueError:
            self.sync_controls()
            self._show_live()
            raise
        if lr is not None:
            t.set_lr(lr)
        if sigma_start is not None and t.aqn is not None:
            t.aqn.sigma_start = sigma_start
        t.config = config
        self._show_live()

    def sync_controls(self) -> None:
        """Show the trainer's values on the sliders (its base lr, AQN sigma_start, temperature),
        widening a slider's range when a value lies outside it; nothing is written back."""
        if self.widget is None:
            return
        t, self._syncing = self.trainer, True
        try:
            lr = float(t.optimizer.param_groups[0].get("initial_lr", t.optimizer.param_groups[0]["lr"]))
            self.lr.min, self.lr.max = min(self.lr.min, math.floor(math.log10(lr))), max(self.lr.max, math.ceil(math.log10(lr)))
            self.lr.value = lr
            if t.aqn is not None:
                sigma = float(t.aqn.sigma_start)
                if sigma not in [v for _, v in self.sigma.options]:
                    self.sigma.options = sigma_options(SIGMA_START_GRID, sigma)
                self.sigma.value = sigma
            temp = float(t.config.rollout.temperature)
            self.temp.min, self.temp.max = min(self.temp.min, temp), max(self.temp.max, temp)
            self.temp.value = temp
        finally:
            self._syncing = False

    def _on_control(self, change) -> None:
        """A slider moved by hand: apply it now, or at the running chunk's end."""
        if self._syncing:
            return
        self._pending.add(change["owner"])
        if not self.running:
            self._apply_sliders()

    def _apply_sliders(self) -> None:
        """Apply the sliders moved by hand (only those: set_lr restarts nothing, but it is not called twice)."""
        moved, self._pending = self._pending, set()
        try:
            self.apply_controls(self.lr.value if self.lr in moved else None,
                                self.sigma.value if self.sigma in moved and self.trainer.aqn else None,
                                self.temp.value if self.temp in moved else None)
        except ValueError as err:  # refused: the sliders are back at the trainer's values; say why
            self._set_status(f"not applied: {err}")

    def live_values(self) -> dict:
        """What the trainer uses now (not what the sliders show): the optimizer's current lr, the
        AQN's sigma_start (None without AQN) and the rollout temperature."""
        t = self.trainer
        return {"lr": float(t.optimizer.param_groups[0]["lr"]),
                "sigma_start": float(t.aqn.sigma_start) if t.aqn is not None else None,
                "temperature": float(t.config.rollout.temperature)}

    def live_text(self) -> str:
        v = self.live_values()
        sigma = "off" if v["sigma_start"] is None else f"{v['sigma_start']:.1e}"
        return f"trainer uses: lr = {v['lr']:.2e}, AQN sigma_start = {sigma}, temperature = {v['temperature']:.2f}"

    def run(self, steps: int, background: bool = False):
        """Train ``steps`` more steps, updating the views after each step.

        A stop flag left from an idle press is cleared first, so the chunk trains. Raises if a
        chunk is already running (the button is disabled meanwhile)."""
        if self.running:
            raise RuntimeError("a chunk is already running; press stop or wait for it to end")
        steps = check_steps("steps", steps)  # the trainer's own check, before the controls change anything
        if self.widget is not None:
            self.sync_controls()  # hand changes are applied already; code changes since are shown now
            self.progress.max, self.progress.value = steps, 0
            self.run_button.disabled = True
        self.trainer.stop_requested = False
        self.running, self._chunk_steps, self._chunk_done = True, steps, 0
        self.chunk_starts.append(self.trainer.step + 1)
        self._set_status(f"running chunk: 0/{steps}")
        if background:
            self._thread = threading.Thread(target=self._train, args=(steps,), daemon=True)
            self._thread.start()
            return self._thread
        self._train(steps)
        return self.trainer

    def stop(self) -> bool:
        """End the running chunk after its current step; True if a chunk was running, else a no-op."""
        if not self.running:
            self._set_status("idle (stop ignored: no chunk is running)")
            return False
        self.trainer.stop_requested = True
        return True

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _train(self, steps: int) -> None:
        try:
            self.trainer.train(steps, callback=self._on_step)
            done = self._chunk_done
            self._set_status(f"idle: chunk of {steps} steps done (step {self.trainer.step})" if done == steps else
                             f"stopped after {done} steps of {steps} (step {self.trainer.step}); idle")
        except BaseException as err:
            self._set_status(f"failed after {self._chunk_done} steps: {type(err).__name__}: {err}")
            raise
        finally:  # the button comes back and the flag is cleared whatever happened in the chunk
            self.running = False
            self.trainer.stop_requested = False
            if self.widget is not None:
                self.run_button.disabled = False
                if self._pending:  # a slider moved during the chunk
                    self._apply_sliders()
            self._draw(force=True)

    def _on_step(self, row: dict) -> None:
        self._chunk_done += 1
        if self.widget is not None:
            self.progress.value += 1
        self._set_status(f"running chunk: {self._chunk_done}/{self._chunk_steps}")
        self._show_live()
        self._draw()

    def _set_status(self, text: str) -> None:
        self.status = text
        if self.widget is not None:
            self.status_label.value = f"<code>{html.escape(text)}</code>"

    def _show_live(self) -> None:
        if self.widget is not None:
            if not self._pending:
                self.sync_controls()
            self.live_label.value = f"<code>{html.escape(self.live_text())}</code>"

    # -- views ----------------------------------------------------------------------------------
    def table_html(self, last: int = 8) -> str:
        rows = [{c: r.get(c, "") for c in _TABLE_COLUMNS} for r in self.trainer.history[-last:]]
        return html_table(rows, caption=f"last {len(rows)} steps")

    def figure(self):
        """The dashboard's plot as a matplotlib Figure (2 x 3 panels, chunk boundaries marked)."""
        return plot_dashboard(self.trainer.history, self.metrics, chunk_starts=self.chunk_starts)

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.trainer.history or (not force and now - self._last_draw < self.redraw_every_s):
            return
        self._last_draw = now
        fig = self.figure()
        if self.widget is not None:
            self.plot.value = figure_html(fig)
            self.table.value = self.table_html()
        else:
            import matplotlib.pyplot as plt

            plt.close(fig)

    def _build(self):
        t = self.trainer
        lr = t.optimizer.param_groups[0].get("initial_lr", t.optimizer.param_groups[0]["lr"])
        style = {"description_width": "90px"}
        self.lr = W.FloatLogSlider(value=lr, base=10, min=-6, max=-1, step=0.01, description="lr",
                                  readout_format=".1e", style=style)
        # AQN's sigma on the AQN panel's grid, which reaches where the tiny model's accuracy breaks (~1)
        sigma = t.aqn.sigma_start if t.aqn else 1e-2
        self.sigma = W.SelectionSlider(options=sigma_options(SIGMA_START_GRID, sigma), value=float(sigma),
                                       description="AQN sigma", disabled=t.aqn is None, style=style)
        self.temp = W.FloatSlider(value=t.config.rollout.temperature, min=0.1, max=2.0, step=0.05,
                                  description="temperature", style=style)
        self.steps = W.IntText(value=10, description="steps")
        self.run_button = W.Button(description="run chunk", icon="play")
        self.stop_button = W.Button(description="stop", icon="stop")
        self.run_button.on_click(lambda _b: self.run(self.steps.value, background=True))
        self.stop_button.on_click(lambda _b: self.stop())
        for control in (self.lr, self.sigma, self.temp):
            control.observe(self._on_control, names="value")
        self.progress = W.IntProgress(value=0, min=0, max=1, description="chunk")
        self.live_label = W.HTML()  # what the trainer uses: a slider may show a snapped value
        self.live_label.add_class("qerl-live-values")
        self.status_label = W.HTML(value="<code>idle</code>")
        self.status_label.add_class("qerl-run-status")
        self.plot, self.table = W.HTML(), W.HTML()
        return W.VBox([W.HBox([self.lr, self.sigma, self.temp]), self.live_label,
                       W.HBox([self.steps, self.run_button, self.stop_button, self.progress]), self.status_label,
                       self.plot, self.table])

    def _ipython_display_(self):
        if self.widget is not None:
            self.sync_controls()
            self._draw(force=True)
            show(self.widget)
        else:
            print(f"TrainingDashboard: {len(self.trainer.history)} steps so far (ipywidgets not installed)")
            if self.trainer.history:
                show(self.figure())
