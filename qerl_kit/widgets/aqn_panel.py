"""AQN panel: sliders for sigma_start, sigma_end, stages (and a step) redraw the schedule, and an
optional probe measures the model's entropy and sample diversity at the selected sigma."""

from __future__ import annotations

from typing import Callable

from qerl_kit.aqn import AQN
from qerl_kit.plots import plot_schedule
from qerl_kit.widgets.common import HAS_WIDGETS, W, figure_html, show


class AQNPanel:
    """Edit an ``AQN`` schedule with sliders; ``probe(sigma) -> dict`` is called on demand.

    The panel writes the slider values into the given ``AQN`` object (its schedule fields are
    plain numbers), so a trainer using that object picks them up at its next step.
    """

    def __init__(self, aqn: AQN | None = None, probe: Callable[[float], dict] | None = None,
                 live_probe: bool = False):
        self.aqn = aqn or AQN()
        self.probe, self.live_probe = probe, live_probe
        self.probe_results: list[dict] = []
        self.widget = self._build() if HAS_WIDGETS else None

    # -- plain values ---------------------------------------------------------------------------
    def readout(self, step: int) -> str:
        a = self.aqn
        return (f"step {step}: stage {a.stage(step)} of {a.stages}, sigma = {a.sigma(step):.3e} "
                f"(schedule {a.sigma_start:.1e} -> {a.sigma_end:.1e})")

    def set(self, sigma_start=None, sigma_end=None, stages=None, total_steps=None) -> None:
        """Change the schedule (validated: an impossible value raises, the AQN is left unchanged)."""
        new = dict(sigma_start=sigma_start or self.aqn.sigma_start, sigma_end=sigma_end or self.aqn.sigma_end,
                   stages=stages or self.aqn.stages, total_steps=total_steps or self.aqn.total_steps)
        AQN(**new, allow_increasing=getattr(self.aqn, "allow_increasing", False))  # validation only
        for key, value in new.items():
            setattr(self.aqn, key, value)

    def run_probe(self, sigma: float) -> dict:
        if self.probe is None:
            raise ValueError("AQNPanel was built without a probe")
        result = {"sigma": sigma, **self.probe(sigma)}
        self.probe_results.append(result)
        return result

    # -- the widget -----------------------------------------------------------------------------
    def _build(self):
        a = self.aqn
        style = {"description_width": "90px"}
        self.s_start = W.FloatLogSlider(value=a.sigma_start, base=10, min=-4, max=-0.5, step=0.01,
                                        description="sigma_start", readout_format=".1e", style=style)
        self.s_end = W.FloatLogSlider(value=a.sigma_end, base=10, min=-5, max=-1, step=0.01,
                                      description="sigma_end", readout_format=".1e", style=style)
        self.s_stages = W.IntSlider(value=a.stages, min=3, max=20, description="stages", style=style)
        self.s_step = W.IntSlider(value=a.total_steps // 2, min=0, max=a.total_steps - 1, description="step",
                                  style=style)
        self.label = W.HTML(layout=W.Layout(min_height="24px"))
        self.label.add_class("qerl-sigma-readout")
        self.plot = W.HTML()
        self.plot.add_class("qerl-schedule-plot")
        self.probe_out = W.HTML()
        for s in (self.s_start, self.s_end, self.s_stages, self.s_step):
            s.observe(self._changed, names="value")
        children = [W.HBox([W.VBox([self.s_start, self.s_end]), W.VBox([self.s_stages, self.s_step])]),
                    self.label, self.plot]
        if self.probe is not None:
            self.probe_button = W.Button(description="measure at this sigma", icon="flask",
                                          layout=W.Layout(width="auto"))
            self.probe_button.on_click(lambda _b: self._probe_now())
            children += [self.probe_button, self.probe_out]
        self._redraw()
        return W.VBox(children)

    def _changed(self, _change) -> None:
        try:
            self.set(self.s_start.value, self.s_end.value, self.s_stages.value)
        except ValueError as err:
            self.label.value = f"<b style='color:#b00'>{err}</b>"
            return
        self._redraw()
        if self.live_probe and self.probe is not None:
            self._probe_now()

    def _redraw(self) -> None:
        step = self.s_step.value
        self.label.value = f"<code>{self.readout(step)}</code>"
        self.plot.value = figure_html(plot_schedule(self.aqn, step=step))

    def _probe_now(self) -> None:
        sigma = self.aqn.sigma(self.s_step.value)
        r = self.run_probe(sigma)
        rows = "".join(f"<tr><td>{x['sigma']:.2e}</td>" + "".join(
            f"<td>{v:.3f}</td>" for k, v in x.items() if k != "sigma") + "</tr>" for x in self.probe_results)
        head = "".join(f"<th>{k}</th>" for k in r)
        self.probe_out.value = f"<table><tr>{head}</tr>{rows}</table>"

    def _ipython_display_(self):
        if self.widget is not None:
            show(self.widget)
        else:  # plain output without ipywidgets
            print(self.readout(self.aqn.total_steps // 2))
            show(plot_schedule(self.aqn))
