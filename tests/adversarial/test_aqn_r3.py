"""Round 3 (the third trial, 2026-12-04): AQN steps, the widgets' arguments, the arith generator.

- a step given to ``AQN`` (``stage``, ``sigma``, ``apply``, ``noise``) or to ``AQNPanel.readout`` is an
  int >= 0 by one rule (``aqn.check_step``): negative, NaN, fractional, bool and string steps are
  refused by name instead of silently giving sigma 0 (or a TypeError from inside);
- ``AQNPanel``'s probe must return a mapping, said naming the probe;
- ``TrainingDashboard``'s ``metrics`` are names the trainer logs (an unknown one lists the known
  names and the nearest; one string is one name, never split into letters) and ``redraw_every_s``
  a finite float >= 0;
- ``tasks.arith.make_dataset``: ``n`` an int >= 0 and levels among ``LEVELS``, as countdown refuses its
  levels.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qerl_kit.aqn import AQN
from qerl_kit.config_types import ConfigError
from qerl_kit.tasks import arith


@pytest.fixture(scope="module")
def model():
    from qerl_kit.models import build_model
    from qerl_kit.quantize import quantize_model

    m = build_model("qwen2-tiny")
    quantize_model(m)
    return m


# ---------------------------------------------------------------- row 17: arith.make_dataset

def test_r3_17_arith_negative_n():
    """``arith.make_dataset("train", n=-1)`` gave [] silently; n must be an int >= 0."""
    with pytest.raises(ValueError, match=r"arith n must be an int >= 0.*got -1"):
        arith.make_dataset("train", n=-1)


def test_r3_17_arith_fractional_or_bool_n():
    """``arith.make_dataset("train", n=2.5)`` gave 3 rows; ``n=True`` is not a count either."""
    for bad in (2.5, True, "4"):
        with pytest.raises(ValueError, match=r"arith n must be an int >= 0"):
            arith.make_dataset("train", n=bad)
    assert arith.make_dataset("train", n=0) == []


def test_r3_17_arith_level_outside_generator():
    """``arith.make_dataset("train", n=2, levels=[99])`` made 99-operation stories; levels are 1-4."""
    for levels in ([99], [0, 1], [2.0], [True], "12", 3, []):
        with pytest.raises(ValueError, match=r"arith level"):
            arith.make_dataset("train", n=2, levels=levels)
    with pytest.raises(ValueError, match=r"arith level must be one of \(1, 2, 3, 4\) .*; got 5"):
        arith.make_problem(__import__("random").Random(0), 5)
    rows = arith.make_dataset("train", n=4, levels=[4, 1])
    assert [r["level"] for r in rows] == [4, 1, 4, 1]


# ---------------------------------------------------------------- row 23: AQN steps

@pytest.mark.parametrize("step", [-7, float("nan"), 2.5, 3.0, "5", None, True, torch.tensor(1.5)])
def test_r3_23_aqn_sigma_refuses_bad_steps(step):
    """``AQN(1e-2, 5e-4, 3, 10).sigma(step)`` with step -7, nan, 2.5 gave 0 silently; '5' a TypeError."""
    aqn = AQN(1e-2, 5e-4, 3, 10)
    for method in (aqn.sigma, aqn.stage):
        with pytest.raises(ConfigError, match=r"step must be an int >= 0.*got") as err:
            method(step)
        assert err.value.key == "step"


def test_r3_23_aqn_apply_refuses_bad_steps(model):
    """``AQN(1e-2, 5e-4, 3, 10).apply(m, -7)`` returned 0 (no noise, silently); ``apply(m, '5')`` and
    ``noise(m, 2.5)`` are refused by name too, even with an explicit sigma, and nothing is perturbed."""
    aqn = AQN(1e-2, 5e-4, 3, 10)
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith("norm.weight")}
    for step in (-7, float("nan"), 2.5, "5"):
        with pytest.raises(ConfigError, match=r"step must be an int >= 0"):
            aqn.apply(model, step)
        with pytest.raises(ConfigError, match=r"step must be an int >= 0"):
            aqn.apply(model, step, sigma=1e-2)
        with pytest.raises(ConfigError, match=r"step must be an int >= 0"):
            with aqn.noise(model, step):
                pass
    assert not aqn.active
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
    # integer steps of any integer type work, past total_steps too (the last stage's sigma)
    assert aqn.sigma(0) == 0.0 and aqn.sigma(np.int64(4)) == pytest.approx(1e-2)
    assert aqn.sigma(torch.tensor(9)) == pytest.approx(5e-4) and aqn.sigma(10**6) == pytest.approx(5e-4)
    assert aqn.apply(model, np.int64(5)) > 0
    aqn.restore(model)


def test_r3_23_panel_readout_refuses_bad_steps():
    """``AQNPanel(AQN(...)).readout('3')`` raised TypeError '>=' str/int; ``readout(-5)`` read stage 0."""
    from qerl_kit.widgets.aqn_panel import AQNPanel

    panel = AQNPanel(AQN(1e-2, 5e-4, 5, 50))
    for step in ("3", -5, 2.5):
        with pytest.raises(ConfigError, match=r"step must be an int >= 0"):
            panel.readout(step)
    assert panel.readout(10).startswith("step 10: stage 1 of 5")


# ---------------------------------------------------------------- row 25: the dashboard's arguments

def _trainer():
    from tests.test_widgets import _FakeTrainer

    return _FakeTrainer()


def test_r3_25_dashboard_unknown_metric():
    """``TrainingDashboard(tr, metrics=['rewrd', 'entropy'])`` drew an empty panel titled 'rewrd'."""
    from qerl_kit.widgets import TrainingDashboard

    with pytest.raises(ConfigError, match=r"metrics: 'rewrd' matches no metric.*'entropy'.*did you mean 'reward'"):
        TrainingDashboard(_trainer(), metrics=["rewrd", "entropy"])
    with pytest.raises(ConfigError, match=r"metrics must be a non-empty list"):
        TrainingDashboard(_trainer(), metrics=[])


def test_r3_25_dashboard_one_metric_string_is_one_name():
    """``TrainingDashboard(tr, metrics='reward')`` split the string into panels 'r', 'e', 'w'..."""
    from qerl_kit.widgets import TrainingDashboard

    tr = _trainer()
    assert TrainingDashboard(tr, metrics="reward").metrics == ("reward",)
    # run-dependent families (one reward function's stats) and columns already logged are known
    tr.history.append({"step": 1, "my/custom": 0.5})
    dash = TrainingDashboard(tr, metrics=["rewards/math_reward/mean", "time/step", "my/custom"])
    assert dash.metrics == ("rewards/math_reward/mean", "time/step", "my/custom")


def test_r3_25_dashboard_redraw_every_s():
    """``TrainingDashboard(tr, redraw_every_s=-1)`` and ``redraw_every_s=nan`` were accepted."""
    from qerl_kit.widgets import TrainingDashboard

    for bad in (-1, float("nan"), math.inf, "soon", True):
        with pytest.raises(ConfigError, match=r"redraw_every_s must be a finite float >= 0"):
            TrainingDashboard(_trainer(), redraw_every_s=bad)
    assert TrainingDashboard(_trainer(), redraw_every_s=0).redraw_every_s == 0.0


# ---------------------------------------------------------------- row 26: the panel's probe

def test_r3_26_probe_must_return_a_mapping():
    """``AQNPanel(AQN(), probe=lambda s: "notadict").run_probe(1e-3)`` raised TypeError 'str' object is
    not a mapping; the error now names the probe and what it returned, and records nothing."""
    from qerl_kit.widgets.aqn_panel import AQNPanel

    panel = AQNPanel(AQN(), probe=lambda s: "notadict")
    with pytest.raises(TypeError, match=r"probe must return a dict.*returned str 'notadict'"):
        panel.run_probe(1e-3)
    assert panel.probe_results == [] and panel.reference_results == []
    good = AQNPanel(AQN(), probe=lambda s: {"entropy": 1.0}, reference_probe=lambda s: [1.0])
    with pytest.raises(TypeError, match=r"reference_probe must return a dict.*returned list"):
        good.run_probe(1e-3)
    with pytest.raises(ConfigError, match=r"sigma must be a finite float in \[0, 10\]"):
        AQNPanel(AQN(), probe=lambda s: {"entropy": 1.0}).run_probe(float("nan"))
