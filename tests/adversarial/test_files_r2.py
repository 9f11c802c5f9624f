"""Files, round 2: what a trainer state and an adapter config hold, checked at load; attach_lora's arguments.

A resume from a ``trainer_state.pt`` whose values are damaged (an AQN schedule AQN refuses, a scheduler
or optimizer state the live objects would not take or would take silently, NaN moments, a step past
total_steps, an RNG state that does not load) is a ``CheckpointError`` naming the file and the key, and
leaves the trainer as it was; an ``adapter_config.json`` whose r / lora_alpha / lora_dropout break the
config's LoRA rules, or that asks for a peft feature the quantized layers lack (DoRA), and an adapter of
integer tensors are refused naming the file; ``attach_lora`` checks r, alpha, dropout and dtype with the
same rules. Rows of the second trial (2026-12-04): 20-26, 34-39.
"""

import copy
import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_kit.adapter_files import ADAPTER_FILE
from qerl_kit import checkpoint as ckpt
from qerl_kit.checkpoint import CheckpointError
from qerl_kit.config import ModelConfig
from qerl_kit.config_types import ConfigError
from qerl_kit.lora import attach_lora, load_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from tests.test_trainer import _trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- resume: the values inside trainer_state.pt (rows 20-26) ------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint after two training steps (total_steps 6, AQN with 3 stages) and its state."""
    trainer = _trainer(tmp_path_factory.mktemp("saved"), save_every=0)
    trainer.train(2)
    path = trainer.save()
    return path, torch.load(path / ckpt.STATE_FILE, weights_only=True)


def _resume(saved, tmp_path, damage):
    """Resume a fresh trainer from a copy of the checkpoint whose state ``damage(state)`` changed."""
    src, state = saved
    path = tmp_path / "run" / src.name
    shutil.copytree(src, path)
    state = copy.deepcopy(state)
    damage(state)
    torch.save(state, path / ckpt.STATE_FILE)
    return path, _trainer(tmp_path)


def _refused(saved, tmp_path, damage, *words):
    path, trainer = _resume(saved, tmp_path, damage)
    with pytest.raises(CheckpointError) as err:
        trainer.resume(path)
    text = str(err.value)
    assert str(path / ckpt.STATE_FILE) in text and "Traceback" not in text
    for word in words:
        assert word in text, (word, text)
    return trainer, text


def test_the_saved_checkpoint_resumes(saved, tmp_path):
    _, trainer = _resume(saved, tmp_path, lambda s: None)
    assert trainer.resume(tmp_path / "run" / saved[0].name) == 2 and trainer.aqn.total_steps == 6


def test_r2_20_aqn_total_steps_negative_is_refused(saved, tmp_path):
    """aqn.config.total_steps = -5 (was: accepted, aqn/sigma 80.0)."""
    _refused(saved, tmp_path, lambda s: s["aqn"]["config"].update(total_steps=-5), "'aqn'", "total_steps")


def test_r2_21_aqn_one_stage_is_refused(saved, tmp_path):
    """aqn.config.stages = 1 (was: accepted, sigma 0 at every step)."""
    _refused(saved, tmp_path, lambda s: s["aqn"]["config"].update(stages=1), "'aqn'", "stages")


@pytest.mark.parametrize("damage,word", [
    (lambda s: s.update(aqn={}), "'config'"),
    (lambda s: s["aqn"]["config"].update(stages="7"), "aqn.config.stages"),
    (lambda s: s["aqn"]["config"].update(seed="x"), "aqn.config.seed"),
    (lambda s: s["aqn"]["config"].update(resample="never"), "resample"),
    (lambda s: s["aqn"].update(generator=torch.zeros(3, dtype=torch.uint8)), "'aqn'"),
])
def test_r2_22_malformed_aqn_state_names_the_file(saved, tmp_path, damage, word):
    """aqn = {}; aqn.config.stages = "7"; seed = "x" (was: KeyError 'config' in aqn.py; TypeError later)."""
    _refused(saved, tmp_path, damage, word)


@pytest.mark.parametrize("damage,key", [
    (lambda s: s.update(scheduler={}), "'scheduler'"),
    (lambda s: s["scheduler"].pop("last_epoch"), "'scheduler'"),
    (lambda s: s["optimizer"].update(param_groups=[]), "'optimizer'"),
    (lambda s: s["rng"].update(python=[1, 2]), "'rng.python'"),
    (lambda s: s["rng"].update(torch=torch.zeros(7, dtype=torch.uint8)), "'rng.torch'"),
])
def test_r2_23_a_structure_the_live_objects_refuse_names_path_and_key(saved, tmp_path, damage, key):
    """scheduler = {}; optimizer.param_groups = []; rng.python = [1, 2] (was: KeyError 'lr_lambdas',
    ValueError about param groups, Random.setstate's error; no file named)."""
    _refused(saved, tmp_path, damage, key)


def test_r2_24_lrs_and_betas_out_of_range_are_refused(saved, tmp_path):
    """scheduler.base_lrs = [1e6]; optimizer betas (5.0, 0.999); maximize: True (was: accepted, lr 1e6)."""
    _refused(saved, tmp_path, lambda s: s["scheduler"].update(base_lrs=[1e6], _last_lr=[1e6]),
             "scheduler.base_lrs[0]", "1000000.0")
    _refused(saved, tmp_path / "b", lambda s: [g.update(betas=(5.0, 0.999)) for g in s["optimizer"]["param_groups"]],
             "optimizer.param_groups[0].betas")
    _refused(saved, tmp_path / "m", lambda s: [g.update(maximize=True) for g in s["optimizer"]["param_groups"]],
             "optimizer.param_groups[0].maximize")


@pytest.mark.parametrize("damage,word", [
    (lambda s: [g.update(lr=math.nan) for g in s["optimizer"]["param_groups"]], "optimizer.param_groups[0].lr"),
    (lambda s: s["scheduler"].update(_last_lr=[math.nan]), "scheduler._last_lr[0]"),
    (lambda s: [v["exp_avg_sq"].fill_(math.nan) for v in s["optimizer"]["state"].values()], ".exp_avg_sq must be finite"),
])
def test_r2_25_nan_in_the_optimizer_or_scheduler_is_refused_at_resume(saved, tmp_path, damage, word):
    """optimizer lr nan, scheduler _last_lr [nan], every exp_avg_sq NaN (was: accepted; a step later a
    NonFiniteError about the lora weights, the checkpoint never named)."""
    _refused(saved, tmp_path, damage, word)


def test_r2_26_a_step_past_total_steps_is_refused(saved, tmp_path):
    """step = 10**12 with total_steps 6 (was: trains step 1000000000001): the step disagrees with the
    state's own history (whatever the schedule), and a cosine run's step past total_steps is refused."""
    _refused(saved, tmp_path, lambda s: s.update(step=10**12), "'step'", "last row of its 'history' is step 2")

    def past_cosine(state):
        config = json.loads(state["config"])
        state["config"] = json.dumps({**config, "total_steps": 1, "optim": {**config["optim"], "schedule": "cosine"}})
    _refused(saved, tmp_path / "cosine", past_cosine, "'step' must be <= the run's total_steps = 1")


def _nan_adapter(path):
    weights = load_file(str(path / ADAPTER_FILE))
    save_file({k: torch.full_like(v, math.nan) for k, v in weights.items()}, str(path / ADAPTER_FILE))


@pytest.mark.parametrize("damage,files,word", [
    (lambda s: s["rng"].update(python=[1, 2]), lambda p: None, "'rng.python'"),  # the last state key
    (lambda s: s["aqn"]["config"].update(seed=7), _nan_adapter, "holds NaN or inf"),  # the adapter, loaded last
])
def test_a_refused_resume_leaves_the_trainer_as_it_was(saved, tmp_path, damage, files, word):
    """A resume refused part-way: the optimizer, scheduler, AQN and adapter are as they were before it."""
    path, trainer = _resume(saved, tmp_path, damage)
    files(path)
    before = (trainer.scheduler.state_dict(), trainer.aqn.seed,
              {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad})
    with pytest.raises(CheckpointError, match=re.escape(word)):
        trainer.resume(path)
    assert trainer.optimizer.state_dict()["state"] == {} and trainer.scheduler.state_dict() == before[0]
    assert trainer.aqn.seed == before[1] == 0 and trainer.step == 0
    assert all(torch.equal(p, before[2][n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


# ---- adapter_config.json and the adapter's tensors (rows 34-37) --------------------------------
@pytest.fixture(scope="module")
def base():
    model = build_model("qwen2-tiny", seed=0)
    quantize_model(model)
    return model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    model = build_model("qwen2-tiny", seed=0)
    quantize_model(model)
    path = tmp_path_factory.mktemp("adapter") / "good"
    attach_lora(model, r=4, seed=0).save_pretrained(str(path))
    return path


def _edited(adapter, tmp_path, config=None, raw=None, weights=None):
    path = tmp_path / "ad"
    shutil.copytree(adapter, path)
    if config or raw:
        text = (path / "adapter_config.json").read_text()
        text = json.dumps({**json.loads(text), **(config or {})}) if config else raw(text)
        (path / "adapter_config.json").write_text(text)
    if weights:
        save_file(weights(load_file(str(path / ADAPTER_FILE))), str(path / ADAPTER_FILE))
    return path


def _load_refused(base, path, *words):
    with pytest.raises(CheckpointError) as err:
        load_lora(base, str(path))
    assert not hasattr(base, "peft_config") and not any("lora_" in n for n, _ in base.named_modules())
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    return str(err.value)


def test_the_good_adapter_loads(base, adapter):
    load_lora(base, str(adapter)).unload()


@pytest.mark.parametrize("alpha", [0, -16])
def test_r2_34_adapter_lora_alpha_zero_or_negative_is_refused(base, adapter, tmp_path, alpha, capsys):
    """adapter_config.json "lora_alpha": 0 / -16 (was: rc 0, the adapter a no-op or sign-flipped)."""
    path = _edited(adapter, tmp_path, config={"lora_alpha": alpha})
    _load_refused(base, path, str(path / "adapter_config.json"), "lora_alpha must be", f"got {alpha}")
    from qerl_kit.cli import main

    capsys.readouterr()
    rc = main(["eval", "--adapter", str(path), "--limit", "1", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "lora_alpha must be" in err and "Traceback" not in err


def test_r2_35_adapter_lora_alpha_nan_or_huge_follows_the_config_rule(base, adapter, tmp_path):
    """adapter_config.json "lora_alpha": NaN / 1e30 (was: NonFiniteError about logits, "learning rate too
    high"). NaN is refused; 1e30 exactly when model.lora_alpha refuses it (one rule)."""
    path = _edited(adapter, tmp_path, raw=lambda t: re.sub(r'"lora_alpha": [^,]+', '"lora_alpha": NaN', t))
    _load_refused(base, path, str(path / "adapter_config.json"), "lora_alpha", "got nan")
    try:
        ModelConfig(lora_alpha=1e30)
        config_refuses = False
    except ConfigError:
        config_refuses = True
    path = _edited(adapter, tmp_path / "huge", config={"lora_alpha": 1e30})
    if config_refuses:
        _load_refused(base, path, "lora_alpha")
    else:
        load_lora(base, str(path)).unload()


def test_r2_36_integer_adapter_tensors_are_refused(base, adapter, tmp_path):
    """adapter_model.safetensors with int64 tensors of the right shapes (was: loaded after a silent cast)."""
    path = _edited(adapter, tmp_path, weights=lambda w: {k: (v * 10).round().to(torch.int64) for k, v in w.items()})
    _load_refused(base, path, str(path / ADAPTER_FILE), "not floating point", "torch.int64", "lora_")


def test_r2_37_dora_adapter_is_refused_naming_the_path(base, adapter, tmp_path):
    """adapter_config.json "use_dora": true (was: AttributeError, NVFP4Linear has no dense .weight)."""
    path = _edited(adapter, tmp_path, config={"use_dora": True})
    _load_refused(base, path, str(path / "adapter_config.json"), "use_dora", "DoRA is not supported on NVFP4")
    path = _edited(adapter, tmp_path / "bias", config={"lora_bias": True})
    _load_refused(base, path, "lora_bias: True is not supported")


# ---- attach_lora's arguments (rows 38, 39) ------------------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(alpha=0), "alpha"), (dict(alpha=-4), "alpha"), (dict(alpha=math.nan), "alpha"),
    (dict(dropout=-0.1), "dropout"), (dict(dropout=1.5), "dropout"),
])
def test_r2_38_attach_lora_alpha_and_dropout_follow_the_config_rules(kw, name):
    """attach_lora(m, r=4, alpha=0 / -4 / nan, dropout=-0.1) (was: accepted silently)."""
    model = build_model("qwen2-tiny", seed=0)
    with pytest.raises(ConfigError, match=rf"^{name} must be .*; got "):
        attach_lora(model, r=4, **kw)
    assert not any("lora_" in n for n, _ in model.named_modules())


@pytest.mark.parametrize("kw,name", [(dict(r=2.5), "r"), (dict(r=True), "r"), (dict(r=0), "r"),
                                     (dict(r=4, dtype=torch.int8), "dtype"), (dict(r=4, dtype="bf16"), "dtype")])
def test_r2_39_attach_lora_rank_and_dtype_are_checked(kw, name):
    """attach_lora(m, r=2.5) / r=True / dtype=torch.int8 (was: TypeError in linear.py; RuntimeError)."""
    model = build_model("qwen2-tiny", seed=0)
    with pytest.raises(ConfigError, match=rf"^{name} must be .*; got "):
        attach_lora(model, **kw)


def test_r2_26_a_constant_schedule_run_past_total_steps_resumes(tmp_path):
    """A constant schedule may train on past total_steps (``optim.steps_to_run``); its checkpoint there
    resumes, while a cosine run's steps past total_steps are refused before they run."""
    trainer = _trainer(tmp_path, total_steps=2, aqn=dict(enabled=False), optim=dict(schedule="constant"))
    trainer.train(3)
    path = trainer.save()
    resumed = _trainer(tmp_path, total_steps=2, aqn=dict(enabled=False), optim=dict(schedule="constant"))
    assert resumed.resume(path) == 3
    cosine = _trainer(tmp_path / "cos", total_steps=2, aqn=dict(enabled=False), optim=dict(schedule="cosine"))
    with pytest.raises(ConfigError, match=r"steps 3\.\.3 would run at lr 0"):
        cosine.train(3)
    assert cosine.step == 0
