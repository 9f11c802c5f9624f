"""Round 2: AQN values set after construction, the AQN panel, the dashboard, the non-finite diagnosis.

Rows 27, 28, 29 and the wording of rows 8 and 10 of the second trial (2026-12-04): every AQN
schedule value set after construction (``a.stages = 2``, ``a.resample = "never"``...) is checked with
the constructor's rules (never a ZeroDivisionError at the next ``sigma(step)``); ``AQNPanel.set`` never
ignores a value (0 raises the rule's ConfigError, nothing changes); the dashboard refuses a
``sigma_start`` that would make the noise grow and snaps its slider back; a non-finite loss or logits
with finite weights list the likely causes (loss.beta, the LoRA scale, the largest weight) instead of
asserting "the learning rate is too high".
"""

import pytest
import torch

from qerl_kit.aqn import AQN
from qerl_kit.config_types import ConfigError
from qerl_kit.finite import NonFiniteError, check_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _aqn(**kw):
    return AQN(**{"sigma_start": 1e-2, "sigma_end": 5e-4, "stages": 3, "total_steps": 10, **kw})


def _values(a):
    return (a.sigma_start, a.sigma_end, a.stages, a.total_steps, a.seed, a.resample, a.allow_increasing)


# ---- row 27: AQN attributes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, match", [
    ("stages", 2, r"^stages must be an int >= 3 \(.*\); got 2$"),
    ("stages", 11, r"^stages must be <= total_steps = 10 \(every stage needs at least one step\); got 11$"),
    ("stages", 2.5, r"^stages must be an int >= 3"),
    ("total_steps", 0, r"^total_steps must be an int >= 1 .*; got 0$"),
    ("total_steps", 2, r"^total_steps must be >= stages = 3 .*; got 2$"),
    ("resample", "never", r"^resample must be one of 'step', 'forward' .*; got 'never'$"),
    ("seed", -1, r"^seed must be an int in \[0, 2\*\*63 - 1\]"),
    ("seed", 2**70, r"^seed must be an int in \[0, 2\*\*63 - 1\]"),
    ("allow_increasing", "maybe", r"^allow_increasing must be a boolean"),
    ("sigma_start", 1e-4, r"^sigma_end must be <= sigma_start = 0\.0001 .*allow_increasing=True.*got 0\.0005; "
                          r"to change both sigmas at once, use aqn\.update"),
])
def test_r2_27_aqn_values_set_after_construction_are_checked(name, value, match):
    """``a = AQN(1e-2, 5e-4, 3, 10); a.<name> = <value>`` (then ``a.sigma(9)``)."""
    a = _aqn()
    before, sigmas = _values(a), [a.sigma(s) for s in range(10)]
    with pytest.raises(ConfigError, match=match):
        setattr(a, name, value)
    assert _values(a) == before and [a.sigma(s) for s in range(10)] == sigmas  # unchanged, still usable


def test_r2_27_several_values_change_together_and_a_new_seed_restarts_the_noise():
    """``a.update(stages=20, total_steps=100)``, ``a.update(sigma_start=1e-4, sigma_end=1e-5)``, ``a.seed = 5``."""
    a = _aqn()
    a.update(stages=20, total_steps=100)  # one at a time, stages=20 > total_steps=10 would be refused
    a.update(sigma_start=1e-4, sigma_end=1e-5)  # one at a time, sigma_start=1e-4 < sigma_end would be
    assert (a.stages, a.total_steps, a.sigma(99)) == (20, 100, pytest.approx(1e-5))
    with pytest.raises(ConfigError, match=r"^total_steps must be >= stages = 20"):
        a.update(stages=20, total_steps=10)
    with pytest.raises(ConfigError, match=r"AQN has no schedule value 'sigma'"):
        a.update(sigma=0.1)
    assert (a.stages, a.total_steps, a.sigma_start) == (20, 100, 1e-4)  # a refused update changes nothing
    a.seed = 5  # restarts the stream, as AQN(seed=5) starts it
    assert torch.equal(torch.randn(4, generator=a._generator), torch.randn(4, generator=_aqn(seed=5)._generator))
    growing = _aqn(allow_increasing=True)
    growing.sigma_start = 1e-4  # allowed: the run asked for growing noise
    with pytest.raises(ConfigError, match=r"^sigma_end must be <= sigma_start"):
        growing.allow_increasing = False


def test_r2_27_a_saved_aqn_state_is_checked_as_a_whole():
    """``b.load_state_dict(sd)`` with ``sd['config']['stages'] = 1`` / ``'total_steps': -5`` / ``'seed': 'x'``."""
    for key, bad, match in (("stages", 1, "stages must be an int >= 3"), ("total_steps", -5, "total_steps must be"),
                            ("seed", "x", "seed must be an int")):
        sd = _aqn().state_dict()
        sd["config"][key] = bad
        b = _aqn(stages=4)
        with pytest.raises(ConfigError, match=match):
            b.load_state_dict(sd)
        assert b.stages == 4 and b.sigma(9) > 0
    sd = _aqn(stages=5, total_steps=50).state_dict()  # stages and total_steps both grow: fine as a whole
    b = _aqn()
    b.load_state_dict(sd)
    assert (b.stages, b.total_steps) == (5, 50)


# ---- row 28: AQNPanel.set --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma_start=0.0), r"^sigma_start must be a finite float in \(0, 10\]"),
    (dict(sigma_end=0), r"^sigma_end must be a finite float in \(0, 10\]"),
    (dict(stages=0), r"^stages must be an int >= 3"),
    (dict(stages=-3), r"^stages must be an int >= 3"),
    (dict(total_steps=0), r"^total_steps must be an int >= 1"),
])
def test_r2_28_panel_set_never_ignores_a_value(kwargs, match):
    """``AQNPanel(AQN(1e-2, 5e-4, 5, 50)).set(**kwargs)``: 0 is not "keep the old value"."""
    from qerl_kit.widgets.aqn_panel import AQNPanel

    panel = AQNPanel(AQN(sigma_start=1e-2, sigma_end=5e-4, stages=5, total_steps=50))
    before = _values(panel.aqn)
    sliders = None if panel.widget is None else (panel.s_start.value, panel.s_end.value, panel.s_stages.value)
    with pytest.raises(ConfigError, match=match):
        panel.set(**kwargs)
    assert _values(panel.aqn) == before
    if sliders is not None:
        assert (panel.s_start.value, panel.s_end.value, panel.s_stages.value) == sliders


def test_r2_28_panel_set_from_code_moves_the_sliders():
    """``panel.set(sigma_start=5e-3, stages=8, total_steps=80)``: the sliders show what the AQN now holds."""
    pytest.importorskip("ipywidgets")
    from qerl_kit.widgets.aqn_panel import AQNPanel

    panel = AQNPanel(AQN(sigma_start=1e-2, sigma_end=5e-4, stages=5, total_steps=50))
    panel.set(sigma_start=3e-3, stages=8, total_steps=80)  # 3e-3 is off the slider's grid: added, not snapped
    assert (panel.aqn.sigma_start, panel.aqn.stages, panel.aqn.total_steps) == (3e-3, 8, 80)
    assert (panel.s_start.value, panel.s_stages.value, panel.s_step.max) == (3e-3, 8, 79)
    assert "3.0e-03" in panel.label.value


# ---- row 29: the dashboard's sigma control -------------------------------------------------------------------

def test_r2_29_dashboard_refuses_growing_noise_and_snaps_back():
    """``TrainingDashboard(tr).apply_controls(sigma_start=1e-4)`` with sigma_end 5e-4 (and the slider moved there)."""
    pytest.importorskip("ipywidgets")
    from qerl_kit.widgets import TrainingDashboard
    from tests.test_widgets import _FakeTrainer

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    with pytest.raises(ConfigError, match=r"^sigma_end must be <= sigma_start = 0\.0001 \(AQN noise decays"):
        dash.apply_controls(lr=3e-4, sigma_start=1e-4)
    assert trainer.aqn.sigma_start == 1e-2 and trainer.lrs == []  # nothing applied, the lr neither
    assert dash.sigma.value == 1e-2
    dash.sigma.value = 1e-4  # by hand: refused, said in the status line, the slider back at the trainer's value
    assert trainer.aqn.sigma_start == 1e-2 and dash.sigma.value == 1e-2
    assert dash.status.startswith("not applied: sigma_end must be <= sigma_start = 0.0001")
    dash.sigma.value = 2e-3  # an allowed value still applies at once
    assert trainer.aqn.sigma_start == 2e-3
    trainer.aqn = AQN(total_steps=100, allow_increasing=True)  # a run that asked for growing noise
    dash.apply_controls(sigma_start=1e-4)
    assert trainer.aqn.sigma_start == 1e-4


# ---- rows 8 and 10: what a non-finite loss or logits say when the weights are finite ---------------------------

@pytest.fixture(scope="module")
def policy():
    from tests.test_trainer import _policy

    return _policy()


def _finite_inputs(n=4, c=3):
    return [torch.zeros(n, c), torch.zeros(n, c), torch.tensor([1.0, -1.0, 50.0, 0.0]), torch.zeros(n, c), None]


def test_r2_08_a_loss_overflowing_from_finite_inputs_lists_the_causes(policy):
    """The loss of ``loss: {beta: 1.0e+300}``: NaN from finite log-probs and advantages."""
    with pytest.raises(NonFiniteError) as err:
        check_loss(float("nan"), 3, slice(0, 4), _finite_inputs(), beta=1e300, model=policy)
    msg = str(err.value)
    assert msg.startswith("step 3: the loss of micro-batch rows 0:4 is nan, from finite inputs (log-probs, old "
                          "log-probs, advantages, reference log-probs): the loss computation overflowed. "
                          "Likely causes (none certain): the KL weight loss.beta = 1e+300 times the KL; "
                          "extreme advantages (max |A| = 50)"), msg
    assert "lora_alpha / r" in msg and "every parameter is finite; the largest is max |w|" in msg
    assert msg.endswith("nothing was updated") and "lower optim.lr" not in msg


def test_r2_08_a_non_finite_input_of_the_loss_is_named():
    """The loss is NaN because the advantages hold a NaN."""
    inputs = _finite_inputs()
    inputs[2] = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    with pytest.raises(NonFiniteError, match=r"^step 1: the loss of micro-batch rows 0:4 is nan: its input, the "
                                             r"advantages, is not finite \(1 NaN and 0 inf of 4 values\); nothing"):
        check_loss(float("nan"), 1, slice(0, 4), inputs, beta=0.0)


def test_r2_08_the_trainer_says_which_input_or_that_the_loss_overflowed(tmp_path, monkeypatch):
    """A trainer step whose loss overflows to inf from finite inputs (as a huge loss.beta makes it)."""
    from qerl_kit import grpo
    from tests.test_trainer import _trainer

    trainer = _trainer(tmp_path, aqn=dict(enabled=False))
    dapo = grpo.LOSSES["dapo"]
    monkeypatch.setitem(grpo.LOSSES, "dapo", grpo.LossSpec(lambda *a, **k: dapo.fn(*a, **k) * 1e300 * 1e300, "tokens"))
    with pytest.raises(NonFiniteError, match=r"^step 1: the loss of micro-batch rows 0:4 is -?inf, from finite inputs "
                                             r"\(log-probs, old log-probs, advantages[^)]*\): the loss computation overflowed"):
        trainer.train(1)


def test_r2_10_non_finite_logits_with_finite_weights_name_the_lora_scale(policy):
    """``model: {lora_alpha: 1.0e+300}``: finite weights, a LoRA scale that overflows float32."""
    from qerl_kit.rollout import HFEngine
    from qerl_kit.rollout.types import SamplingParams
    from tests.test_rollout import make_tokenizer

    layers = [m for m in policy.modules() if isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A")]
    saved = [dict(m.scaling) for m in layers]
    try:
        for m in layers:
            m.scaling = {k: 1e300 for k in m.scaling}
        with pytest.raises(NonFiniteError) as err:
            HFEngine(policy, make_tokenizer()).generate(["ab"], 1, SamplingParams(max_new_tokens=2, seed=0))
    finally:
        for m, s in zip(layers, saved):
            m.scaling = s
    msg = str(err.value)
    assert "at decode step 0" in msg and "every parameter is finite; the largest is max |w| = " in msg
    assert "the LoRA scale lora_alpha / r is 1e+300 (beyond float32's range: it overflows by itself)" in msg
    assert "Likely causes (none certain): an adapter scale (model.lora_alpha / r)" in msg
