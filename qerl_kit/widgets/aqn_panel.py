"""AQN panel: sliders for sigma_start, sigma_end, stages (and a step) redraw the schedule, and an
optional probe measures the model's entropy, sample diversity and accuracy at sigma_start.

The sigma sliders move over fixed, readable grids (``SIGMA_START_GRID``, ``SIGMA_END_GRID``)
rather than a continuous log scale: the interesting range of the shipped tiny model (where its
accuracy breaks, sigma ~ 1) and the paper's range (1e-2 -> 5e-4) are both a few ticks wide.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Callable

from qerl_kit.aqn import AQN, check_step
from qerl_kit.config_types import check_sigma, short_repr
from qerl_kit.plots import plot_schedule
from qerl_kit.widgets.common import HAS_WIDGETS, W, figure_html, show

# 1-2-5 steps from 1e-4, then finer steps where the shipped NVFP4 tiny model changes (measured with
# notebook 03's probe, 8 problems x 8 samples): entropy, distinct samples and accuracy equal sigma 0's
# up to 0.5; at 0.7 accuracy is still 0.50 (0.52 at sigma 0), at 1.0 it is 0 and entropy 7.6x; at 2.0
# all samples differ and at 3.0 entropy is 35x sigma 0's (5.0 adds little: 40x, accuracy still ~0).
SIGMA_START_GRID = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 0.7, 0.8, 0.9, 1.0,
                    1.5, 2.0, 3.0)
# sigma_end reaches as high as sigma_start's grid so a start below the end can be chosen (and is refused).
SIGMA_END_GRID = (1e-5, 2e-5, 5e-5) + SIGMA_START_GRID
SLIDER_WIDTH = "460px"


def sigma_options(grid, value: float) -> list[tuple[str, float]]:
    """``(label, value)`` options of a ``SelectionSlider``: the grid, plus ``value`` if it is not on it
    (so an AQN built with an off-grid sigma is shown exactly, never snapped)."""
    values = sorted(set(grid) | {float(value)})
    return [(f"{v:.1e}", v) for v in values]


def _call_probe(name: str, probe: Callable[[float], dict], sigma: float) -> Mapping:
    """``probe(sigma)``, which must return a mapping of metric name -> value (a row of the table);
    anything else is refused naming the probe, not a ``TypeError`` from inside ``{**result}``."""
    result = probe(sigma)
    if not isinstance(result, Mapping):
        raise TypeError(f"AQNPanel's {name} must return a dict of metric name -> value (e.g. "
                        f"{{'entropy': 0.7, 'accuracy': 0.5}}); {name}({sigma:g}) returned "
                        f"{type(result).__name__} {short_repr(result, 80)}")
    return result


class AQNPanel:
    """Edit an ``AQN`` schedule with sliders; ``probe(sigma) -> dict`` is called on demand.

    The panel writes the slider values into the given ``AQN`` object (its schedule fields are
    plain numbers), so a trainer using that object picks them up at its next step. The
    **measure** button calls ``probe`` at the ``sigma_start`` slider's value; at the first measure
    it also measures the reference rows, shown first in the table: ``probe(0.0)`` (the same model
    without AQN noise) and, if given, ``reference_probe(0.0)`` (e.g. the dense bf16 model).
    """

    def __init__(self, aqn: AQN | None = None, probe: Callable[[float], dict] | None = None,
                 live_probe: bool = False, reference_probe: Callable[[float], dict] | None = None,
                 labels: tuple[str, str] = ("quantized", "dense bf16")):
        self.aqn = aqn or AQN()
        self.probe, self.live_probe, self.reference_probe = probe, live_probe, reference_probe
        self.labels = labels  # (the probed model, the reference model), as the table names them
        self._syncing = False  # a slider's change is being applied, or the sliders synced
        self.probe_results: list[dict] = []      # one row per measure, in order
        self.reference_results: list[dict] = []  # filled once, at the first measure
        self.widget = self._build() if HAS_WIDGETS else None

    # -- plain values ---------------------------------------------------------------------------
    def readout(self, step: int) -> str:
        a, step = self.aqn, check_step(step)  # the AQN's rule: an int >= 0
        return (f"step {step}: stage {a.stage(step)} of {a.stages}, sigma = {a.sigma(step):.3e} "
                f"(schedule {a.sigma_start:.1e} -> {a.sigma_end:.1e})")

    def set(self, sigma_start=None, sigma_end=None, stages=None, total_steps=None) -> None:
        """Change the schedule: the values given (None = keep) are checked together by the AQN's own
        rules (``AQN.update``), so 0, a negative or any refused value raises that rule's ``ConfigError``
        and leaves the AQN and the sliders as they were; an accepted change moves the sliders too."""
        given = dict(sigma_start=sigma_start, sigma_end=sigma_end, stages=stages, total_steps=total_steps)
        self.aqn.update(**{key: value for key, value in given.items() if value is not None})
        if self.widget is not None and not self._syncing:
            self._show_values()

    def _show_values(self) -> None:
        """The sliders show the AQN's values (after a change from code), without writing them back."""
        a, self._syncing = self.aqn, True
        try:
            self.s_start.options = sigma_options(SIGMA_START_GRID, a.sigma_start)
            self.s_start.value = float(a.sigma_start)
            self.s_end.options = sigma_options(SIGMA_END_GRID, a.sigma_end)
            self.s_end.value = float(a.sigma_end)
            self.s_stages.max = max(self.s_stages.max, a.stages)
            self.s_stages.value = a.stages
            self.s_step.max = a.total_steps - 1
        finally:
            self._syncing = False
        self._redraw()

    def measure_sigma(self) -> float:
        """The sigma the measure button uses: the sigma_start slider's value (the AQN's without widgets)."""
        return float(self.s_start.value) if self.widget is not None else float(self.aqn.sigma_start)

    def run_probe(self, sigma: float) -> dict:
        if self.probe is None:
            raise ValueError("AQNPanel was built without a probe")
        sigma = check_sigma("sigma", sigma, zero=True)  # AQN.apply's rule for one sigma applied now
        self._measure_references()
        result = {"model": f"{self.labels[0]} + AQN", "sigma": float(sigma), **_call_probe("probe", self.probe, sigma)}
        self.probe_results.append(result)
        if self.widget is not None:
            self.probe_out.value = self.table_html()
        return result

    def measure(self) -> dict:
        """What the button does: probe at ``measure_sigma()`` (the references first, once)."""
        return self.run_probe(self.measure_sigma())

    def _measure_references(self) -> None:
        if self.reference_results:
            return
        rows = [{"model": f"{self.labels[0]}, no AQN (reference)", "sigma": 0.0, **_call_probe("probe", self.probe, 0.0)}]
        if self.reference_probe is not None:
            rows.append({"model": f"{self.labels[1]} (reference)", "sigma": 0.0,
                         **_call_probe("reference_probe", self.reference_probe, 0.0)})
        self.reference_results = rows

    def table_html(self) -> str:
        """References first, then the measured rows, one column per metric."""
        rows = self.reference_results + self.probe_results
        if not rows:
            return ""
        keys = list(dict.fromkeys(k for r in rows for k in r))
        head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)

        def cell(r, k):
            v = r.get(k, "")
            if k == "sigma":
                return f"{v:.2e}"
            return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))

        body = "".join("<tr>" + "".join(f"<td>{cell(r, k)}</td>" for k in keys) + "</tr>" for r in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    # -- the widget -----------------------------------------------------------------------------
    def _build(self):
        a = self.aqn
        style = {"description_width": "90px"}
        wide = W.Layout(width=SLIDER_WIDTH)
        self.s_start = W.SelectionSlider(options=sigma_options(SIGMA_START_GRID, a.sigma_start),
                                         value=float(a.sigma_start), description="sigma_start", style=style,
                                         layout=wide, readout=True)
        self.s_end = W.SelectionSlider(options=sigma_options(SIGMA_END_GRID, a.sigma_end), value=float(a.sigma_end),
                                       description="sigma_end", style=style, layout=wide, readout=True)
        self.s_stages = W.IntSlider(value=a.stages, min=3, max=20, description="stages", style=style)
        self.s_step = W.IntSlider(value=a.total_steps // 2, min=0, max=a.total_steps - 1, description="step",
                                  style=style)
        self.label = W.HTML(layout=W.Layout(min_height="24px"))
        self.label.add_class("qerl-sigma-readout")
        self.plot = W.HTML()
        self.plot.add_class("qerl-schedule-plot")
        self.probe_out = W.HTML()
        self.probe_out.add_class("qerl-probe-table")
        for s in (self.s_start, self.s_end, self.s_stages, self.s_step):
            s.observe(self._changed, names="value")
        children = [W.HBox([W.VBox([self.s_start, self.s_end]), W.VBox([self.s_stages, self.s_step])]),
                    self.label, self.plot]
        if self.probe is not None:
            self.probe_button = W.Button(icon="flask", layout=W.Layout(width="auto"))
            self.probe_button.on_click(lambda _b: self.measure())
            children += [self.probe_button, self.probe_out]
        self._redraw()
        return W.VBox(children)

    def _button_label(self) -> None:
        if self.probe is not None:
            self.probe_button.description = f"measure at sigma_start = {self.s_start.value:.1e}"

    def _changed(self, _change) -> None:
        if self._syncing:  # the sliders are being set to the AQN's values: nothing to write back
            return
        self._button_label()  # the button names the slider's value even when the schedule is refused
        self._syncing = True  # set() leaves the sliders as the user moved them
        try:
            self.set(self.s_start.value, self.s_end.value, self.s_stages.value)
        except ValueError as err:
            self.label.value = f"<b style='color:#b00'>{html.escape(str(err))}</b>"
            return
        finally:
            self._syncing = False
        self._redraw()
        if self.live_probe and self.probe is not None:
            self.measure()

    def _redraw(self) -> None:
        self._button_label()
        step = self.s_step.value
        self.label.value = f"<code>{self.readout(step)}</code>"
        self.plot.value = figure_html(plot_schedule(self.aqn, step=step))

    def _ipython_display_(self):
        if self.widget is not None:
            show(self.widget)
        else:  # plain output without ipywidgets
            print(self.readout(self.aqn.total_steps // 2))
            show(plot_schedule(self.aqn))
