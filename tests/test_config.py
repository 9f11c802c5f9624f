"""Configs: presets, YAML round trip, typed coercion and validation of every field, clear errors."""

import dataclasses
import math
import re
import typing

import pytest

from qerl_kit.config import (PRESETS, AQNConfig, ConfigError, DataConfig, FilterConfig, LossConfig, ModelConfig,
                             OptimConfig, RolloutConfig, TrainConfig, from_dict, load_config, preset, save_config)

SECTIONS = {"model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "loss": LossConfig,
            "filters": FilterConfig, "optim": OptimConfig, "aqn": AQNConfig}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_round_trip_through_yaml(name, tmp_path):
    cfg = preset(name)
    path = tmp_path / "c.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_hold_the_declared_types(name):
    cfg = preset(name)
    for section in [cfg, *(getattr(cfg, s) for s in SECTIONS)]:
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            tp = hints[f.name]
            if tp is float:
                assert type(value) is float, (f.name, value)
            elif tp is int:
                assert type(value) is int, (f.name, value)
            elif tp is bool:
                assert type(value) is bool, (f.name, value)


def test_paper_presets_follow_table_4():
    g = preset("paper-gsm8k")
    assert (g.rollout.batch_size, g.rollout.group_size, g.rollout.prompts_per_step) == (128, 8, 16)
    assert (g.loss.mu, g.optim.lr, g.model.lora_r, g.rollout.max_new_tokens) == (4, 1e-5, 32, 4096)
    assert (g.aqn.sigma_start, g.aqn.sigma_end, g.aqn.stages) == (1e-2, 5e-4, 10)
    b = preset("paper-bigmath")
    assert (b.rollout.group_size, b.loss.eps_high, b.loss.loss, b.rollout.max_new_tokens) == (16, 0.28, "dapo", 8192)


def test_yaml_preset_plus_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("preset: tiny-cpu\noptim:\n  lr: 0.5\nrollout:\n  group_size: 4\n  batch_size: 32\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 0.5 and cfg.rollout.prompts_per_step == 8
    assert cfg.loss == preset("tiny-cpu").loss


# ---- YAML 1.1 strings: `1e-5` and quoted booleans ------------------------------------------------
def test_yaml_exponent_without_a_dot_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-5\n  weight_decay: 1e-2\nloss:\n  beta: 4e-2\n  eps_high: 2.8e-1\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 1e-5 and type(cfg.optim.lr) is float
    assert cfg.optim.weight_decay == 1e-2 and cfg.loss.beta == 4e-2 and cfg.loss.eps_high == 0.28


def test_yaml_quoted_booleans_mean_what_they_say(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text('preset: paper-bigmath\naqn:\n  enabled: "false"\nfilters:\n  dynamic_sampling: "off"\n'
                    'model:\n  trust_remote_code: "no"\n  gradient_checkpointing: "Yes"\n')
    cfg = load_config(path)
    assert cfg.aqn.enabled is False and cfg.filters.dynamic_sampling is False
    assert cfg.model.trust_remote_code is False and cfg.model.gradient_checkpointing is True


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(ValueError, match="broken.yaml.*group_size"):
        load_config(path)


def test_yaml_merge_keys_still_work_and_an_explicit_key_overrides_a_merged_one(tmp_path):
    """The duplicate-key check (config_yaml) leaves YAML's merge keys alone: `<<:` then an explicit key
    is an override the YAML spec defines, not a key given twice."""
    path = tmp_path / "merge.yaml"
    path.write_text("preset: tiny-cpu\noptim:\n  <<: {lr: 1.0e-3, max_grad_norm: 0.5}\n  lr: 3.0e-3\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 3e-3 and cfg.optim.max_grad_norm == 0.5
    path.write_text("\ufeffpreset: tiny-cpu\nmodel:\n  lora_r: 8\n")  # a byte-order mark is not part of YAML
    assert load_config(path).model.lora_r == 8
    path.write_bytes(b"preset: tiny-cpu\nseed: \xff\n")
    with pytest.raises(ValueError, match=r"merge.yaml: not UTF-8 text"):
        load_config(path)


def test_yaml_bad_value_names_file_key_value_and_allowed(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("preset: tiny-cpu\noptim:\n  lr: fast\n")
    with pytest.raises(ValueError) as err:
        load_config(path)
    msg = str(err.value)
    assert "bad.yaml" in msg and "optim.lr" in msg and "'fast'" in msg and "float" in msg


def re_repr(value) -> str:
    return re.escape(repr(value))


# ---- the coercion rules, per type --------------------------------------------------------------
@pytest.mark.parametrize("text, value", [
    ("true", True), ("True", True), ("TRUE", True), ("yes", True), ("on", True), ("1", True), (" On ", True),
    ("false", False), ("False", False), ("no", False), ("OFF", False), ("0", False), (True, True), (False, False),
])
def test_bool_fields_accept_true_false_and_their_spellings(text, value):
    assert from_dict(dict(aqn=dict(enabled=text))).aqn.enabled is value
    assert from_dict(dict(filters=dict(dynamic_sampling=text))).filters.dynamic_sampling is value
    assert from_dict(dict(log_tensorboard=text)).log_tensorboard is value


@pytest.mark.parametrize("bad", ["maybe", "", "2", "nope", 2, 1.0, None, [], "truee"])
def test_bool_fields_reject_anything_else(bad):
    with pytest.raises(ValueError, match=r"aqn\.enabled must be a boolean.*got " + re_repr(bad)):
        from_dict(dict(aqn=dict(enabled=bad)))


@pytest.mark.parametrize("given, value", [(3e-4, 3e-4), (1, 1.0), ("3e-4", 3e-4), ("1e-5", 1e-5), (" 2e-3 ", 2e-3),
                                          ("0.5", 0.5), ("1", 1.0)])
def test_float_fields_accept_ints_floats_and_numeric_strings(given, value):
    lr = from_dict(dict(optim=dict(lr=given))).optim.lr
    assert lr == value and type(lr) is float


@pytest.mark.parametrize("bad", [True, False, "abc", "1e-5x", "", None, [1e-5], "fast"])
def test_float_fields_reject_bools_and_non_numbers(bad):
    with pytest.raises(ValueError, match=r"optim\.lr must be a finite float.*got " + re_repr(bad)):
        from_dict(dict(optim=dict(lr=bad)))


@pytest.mark.parametrize("given, value", [(7, 7), ("7", 7), (" 12 ", 12), (7.0, 7), ("1e3", 1000)])
def test_int_fields_accept_ints_and_integral_strings(given, value):
    seed = from_dict(dict(seed=given)).seed
    assert seed == value and type(seed) is int


@pytest.mark.parametrize("bad", [1.5, "1.5", "abc", True, False, None, "", float("nan"), float("inf"), -1, 2**40])
def test_seed_must_be_an_int_in_range(bad):
    with pytest.raises(ValueError, match=r"^seed must be an int.*got " + re_repr(bad)):
        from_dict(dict(seed=bad))


@pytest.mark.parametrize("key", ["total_steps", "save_every", "keep_checkpoints", "eval_every"])
def test_top_level_int_fields_reject_fractions_and_bools(key):
    for bad in (2.5, True, "x"):
        with pytest.raises(ValueError, match=rf"^{key} must be an int"):
            from_dict({key: bad})


def test_optional_fields_accept_none_and_the_strings_null_and_none():
    for none in (None, "null", "none", "None", "NULL"):
        cfg = from_dict(dict(model=dict(lora_alpha=none), loss=dict(eps_high=none, is_correction=none),
                             data=dict(eval_dataset=none)))
        assert cfg.model.lora_alpha is None and cfg.loss.eps_high is None
        assert cfg.loss.is_correction is None and cfg.data.eval_dataset is None
    cfg = from_dict(dict(model=dict(lora_alpha="32"), loss=dict(eps_high="0.28")))
    assert cfg.model.lora_alpha == 32.0 and type(cfg.model.lora_alpha) is float and cfg.loss.eps_high == 0.28
    with pytest.raises(ValueError, match=r"model\.lora_alpha must be null or a finite float > 0.*got 'x'"):
        from_dict(dict(model=dict(lora_alpha="x")))


def test_betas_are_two_floats_in_0_1():
    assert from_dict(dict(optim=dict(betas=["0.9", 0.95]))).optim.betas == (0.9, 0.95)
    for bad in ((0.9,), (0.9, 0.99, 0.999), "0.9", 0.9, (1.0, 0.99), (0.9, -0.1), (0.9, float("nan"))):
        with pytest.raises(ValueError, match=r"optim\.betas"):
            from_dict(dict(optim=dict(betas=bad)))


def test_numpy_scalars_are_numbers_and_booleans():
    np = pytest.importorskip("numpy")
    cfg = from_dict(dict(aqn=dict(enabled=np.False_), seed=np.int64(3), optim=dict(lr=np.float64(1e-3))))
    assert cfg.aqn.enabled is False and type(cfg.seed) is int and type(cfg.optim.lr) is float
    with pytest.raises(ValueError, match=r"optim\.lr must be a finite float"):
        from_dict(dict(optim=dict(lr=np.True_)))


def test_str_fields_reject_non_strings_and_accept_paths(tmp_path):
    assert from_dict(dict(output_dir=tmp_path)).output_dir == str(tmp_path)
    for bad in (3, None, ""):
        with pytest.raises(ValueError, match=r"^output_dir must be a non-empty string.*got " + re_repr(bad)):
            from_dict(dict(output_dir=bad))
    with pytest.raises(ValueError, match=r"model\.name must be a non-empty string"):
        from_dict(dict(model=dict(name=7)))


# ---- choices come from the registries that define them -------------------------------------------
def test_choices_follow_the_registries():
    from qerl_kit import grpo
    from qerl_kit.aqn import AQN
    from qerl_kit.formats import FORMATS

    for loss in grpo.LOSSES:
        assert LossConfig(loss=loss).loss == loss
    for scale in grpo.SCALES:
        assert LossConfig(scale_rewards=scale).scale_rewards == scale
    for mode in grpo.IS_MODES:
        assert LossConfig(is_correction=mode).is_correction == mode
    for fmt in [*FORMATS, "none"]:
        assert ModelConfig(format=fmt).format == fmt
    for resample in ("step", "forward"):
        assert AQNConfig(resample=resample).resample == resample
        AQN(resample=resample)


@pytest.mark.parametrize("section, key, bad, allowed", [
    ("loss", "loss", "ppo", "'grpo', 'dapo', 'dr_grpo'"),
    ("loss", "scale_rewards", "std", "'group', 'batch', 'none'"),
    ("loss", "is_correction", "token", "null or one of 'token_truncate'"),
    ("model", "format", "int3", "'nvfp4', 'mxfp4', 'nf4', 'none'"),
    ("rollout", "engine", "fast", "'auto', 'hf', 'static', 'vllm'"),
    ("optim", "schedule", "step", "'constant', 'linear', 'cosine'"),
    ("optim", "optimizer", "sgd", "'adamw', 'adamw8bit'"),
    ("aqn", "resample", "batch", "'step', 'forward'"),
])
def test_choice_errors_name_key_value_and_choices(section, key, bad, allowed):
    with pytest.raises(ValueError) as err:
        from_dict({section: {key: bad}})
    msg = str(err.value)
    assert msg.startswith(f"{section}.{key} must be ") and allowed in msg and msg.endswith(f"got {bad!r}")


# ---- values that make training wrong ----------------------------------------------------------
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("bad, key", [
    (dict(optim=dict(max_grad_norm=0)), "optim.max_grad_norm"),
    (dict(optim=dict(max_grad_norm=-1.0)), "optim.max_grad_norm"),
    (dict(optim=dict(max_grad_norm=NAN)), "optim.max_grad_norm"),
    (dict(loss=dict(is_cap=0.0)), "loss.is_cap"),
    (dict(loss=dict(is_cap=-3.0)), "loss.is_cap"),
    (dict(loss=dict(is_cap=0.5)), "loss.is_cap"),
    (dict(loss=dict(is_cap=INF)), "loss.is_cap"),
    (dict(aqn=dict(sigma_start=NAN)), "aqn.sigma_start"),
    (dict(aqn=dict(sigma_start=INF)), "aqn.sigma_start"),
    (dict(aqn=dict(sigma_end=-1e-3)), "aqn.sigma_end"),
    (dict(aqn=dict(sigma_end="nan")), "aqn.sigma_end"),
    (dict(aqn=dict(sigma_start=-1e-2, enabled=False)), "aqn.sigma_start"),
    (dict(rollout=dict(temperature=INF)), "rollout.temperature"),
    (dict(rollout=dict(temperature=NAN)), "rollout.temperature"),
    (dict(rollout=dict(temperature=0)), "rollout.temperature"),
    (dict(rollout=dict(temperature=-1.0)), "rollout.temperature"),
    (dict(rollout=dict(top_p=0.0)), "rollout.top_p"),
    (dict(rollout=dict(top_p=1.5)), "rollout.top_p"),
    (dict(rollout=dict(top_p=NAN)), "rollout.top_p"),
    (dict(rollout=dict(top_k=-1)), "rollout.top_k"),
    (dict(rollout=dict(max_new_tokens=0)), "rollout.max_new_tokens"),
    (dict(rollout=dict(group_size=1)), "rollout.group_size"),
    (dict(optim=dict(lr=0)), "optim.lr"),
    (dict(optim=dict(lr=-1e-5)), "optim.lr"),
    (dict(optim=dict(lr=NAN)), "optim.lr"),
    (dict(optim=dict(lr="inf")), "optim.lr"),
    (dict(optim=dict(weight_decay=-0.1)), "optim.weight_decay"),
    (dict(optim=dict(warmup_ratio=1.0)), "optim.warmup_ratio"),
    (dict(optim=dict(warmup_ratio=-0.1)), "optim.warmup_ratio"),
    (dict(total_steps=0), "total_steps"),
    (dict(save_every=-1), "save_every"),
    (dict(eval_every=-5), "eval_every"),
    (dict(keep_checkpoints=-1), "keep_checkpoints"),
    (dict(loss=dict(beta=-0.1)), "loss.beta"),
    (dict(loss=dict(eps_low=0.0)), "loss.eps_low"),
    (dict(loss=dict(eps_low=1.0)), "loss.eps_low"),
    (dict(loss=dict(eps_high=0.0)), "loss.eps_high"),
    (dict(loss=dict(eps_high=-0.2)), "loss.eps_high"),
    (dict(loss=dict(mu=0)), "loss.mu"),
    (dict(loss=dict(micro_batch=0)), "loss.micro_batch"),
    (dict(filters=dict(max_sampling_rounds=0)), "filters.max_sampling_rounds"),
    (dict(filters=dict(overlong_buffer=-1)), "filters.overlong_buffer"),
    (dict(filters=dict(overlong_buffer=100), rollout=dict(max_new_tokens=64)), "filters.overlong_buffer"),
    (dict(filters=dict(overlong_penalty=-1.0)), "filters.overlong_penalty"),
    (dict(model=dict(lora_r=0)), "model.lora_r"),
    (dict(model=dict(lora_alpha=0.0)), "model.lora_alpha"),
    (dict(model=dict(lora_alpha=-16)), "model.lora_alpha"),
    (dict(data=dict(eval_size=0)), "data.eval_size"),
    (dict(data=dict(train_size=0)), "data.train_size"),
    (dict(aqn=dict(stages=2)), "aqn.stages"),
])
def test_values_that_make_training_wrong_are_errors_naming_the_key(bad, key):
    with pytest.raises(ValueError, match=rf"^{key.replace('.', '[.]')} must be .*; got "):
        from_dict(bad)


def test_errors_name_key_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        from_dict(dict(optim=dict(max_grad_norm=-1)))
    msg = str(err.value)
    assert msg.startswith("optim.max_grad_norm must be a finite float >= 1e-06") and msg.endswith("got -1")
    assert err.value.key == "optim.max_grad_norm" and err.value.value == -1 and ">= 1e-06" in err.value.allowed
    with pytest.raises(ValueError, match=r"rollout\.temperature must be a finite float >= 0\.0001.*got inf"):
        from_dict(dict(rollout=dict(temperature=INF)))


def test_the_defaults_and_edges_that_are_allowed():
    cfg = from_dict(dict(rollout=dict(top_p=1.0, top_k=0, temperature=1e-3), optim=dict(weight_decay=0, warmup_ratio=0),
                         loss=dict(beta=0, is_cap=1.0), filters=dict(overlong_buffer=64), save_every=0, eval_every=0,
                         keep_checkpoints=0, seed=2**32 - 1))
    assert cfg.loss.is_cap == 1.0 and cfg.seed == 2**32 - 1 and cfg.filters.overlong_buffer == 64
    # AQN off: its stage count is not used, so a demo of 2 steps keeps the default 10 stages
    assert from_dict(dict(aqn=dict(enabled=False), total_steps=2)).aqn.stages == 10


# ---- AQN noise that grows only on purpose ------------------------------------------------------
def test_increasing_aqn_noise_needs_allow_increasing():
    with pytest.raises(ValueError,
                       match=r"aqn\.sigma_end must be <= aqn\.sigma_start.*aqn\.allow_increasing: true.*got 0\.05"):
        from_dict(dict(aqn=dict(sigma_start=1e-2, sigma_end=5e-2)))
    cfg = from_dict(dict(aqn=dict(sigma_start=1e-2, sigma_end=5e-2, allow_increasing="true")))
    assert cfg.aqn.allow_increasing is True and cfg.aqn.sigma_end == 5e-2
    assert from_dict(dict(aqn=dict(sigma_start=1e-2, sigma_end=1e-2))).aqn.allow_increasing is False  # flat is fine


# ---- every field of every section is checked ---------------------------------------------------
def _all_fields():
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f.name
    for f in dataclasses.fields(TrainConfig):
        if f.name not in SECTIONS:
            yield None, f.name


@pytest.mark.parametrize("section, key", list(_all_fields()))
def test_every_field_rejects_a_value_of_the_wrong_type(section, key):
    bad = {"not": "a value"}
    d = {section: {key: bad}} if section else {key: bad}
    dotted = f"{section}.{key}" if section else key
    with pytest.raises(ValueError, match=rf"^{dotted.replace('.', '[.]')} must be .*got \{{'not': 'a value'\}}$"):
        from_dict(d)


# ---- unknown keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    (dict(learning_rate=1e-5), r"unknown config key 'learning_rate'.*allowed: .*'optim'.*'total_steps'"),
    (dict(optim=dict(lr=1e-5, momentum=0.9)), r"unknown config key 'optim\.momentum'.*allowed in 'optim': .*'lr'"),
    (dict(optim=dict(lrr=1e-5)), r"unknown config key 'optim\.lrr'.*did you mean 'lr'"),
    (dict(aqn=dict(sigma=0.1, steps=3)), r"unknown config keys 'aqn\.sigma', 'aqn\.steps'"),
    (dict(optim=0.1), r"optim must be a mapping"),
])
def test_unknown_keys_are_errors_naming_them_and_the_allowed_keys(bad, match):
    with pytest.raises(ValueError, match=match):
        from_dict(bad)


@pytest.mark.parametrize("bad, match", [
    (dict(rollout=dict(group_size=1)), "group_size must be an int in \\[2, 1048576\\]"),
    (dict(rollout=dict(batch_size=20, group_size=8)), "multiple of rollout.group_size"),
    (dict(loss=dict(loss="ppo")), "'grpo', 'dapo', 'dr_grpo'"),
    (dict(aqn=dict(stages=2)), r"aqn\.stages must be an int >= 3"),
    (dict(total_steps=5), "at least aqn.stages"),
    (dict(model=dict(format="int3")), "model.format"),
    (dict(optim=dict(lr=0)), r"optim\.lr must be a finite float in \[1e-09, 1\]"),
])
def test_impossible_values_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        from_dict(bad)


# ---- every way of building a config goes through the same checks -------------------------------
def test_presets_with_overrides_are_coerced_and_checked():
    cfg = preset("tiny-cpu", optim={"lr": "1e-5"}, aqn={"enabled": "off"}, total_steps="40")
    assert cfg.optim.lr == 1e-5 and cfg.aqn.enabled is False and cfg.total_steps == 40
    with pytest.raises(ValueError, match=r"optim\.max_grad_norm"):
        preset("paper-gsm8k", optim={"max_grad_norm": 0})


def test_direct_constructors_and_dataclasses_replace_are_coerced_and_checked():
    assert OptimConfig(lr="1e-5").lr == 1e-5
    assert AQNConfig(enabled="false").enabled is False
    assert FilterConfig(dynamic_sampling="off").dynamic_sampling is False
    with pytest.raises(ValueError, match=r"optim\.max_grad_norm"):
        OptimConfig(max_grad_norm=0)
    with pytest.raises(ValueError, match=r"rollout\.temperature"):
        dataclasses.replace(RolloutConfig(), temperature=float("nan"))
    with pytest.raises(ValueError, match=r"^seed must be an int"):
        dataclasses.replace(TrainConfig(), seed=1.5)
    cfg = TrainConfig(optim={"lr": "3e-4"}, aqn={"enabled": "no"})  # sections may be given as mappings
    assert cfg.optim == OptimConfig(lr=3e-4) and cfg.aqn.enabled is False
    with pytest.raises(ValueError, match=r"unknown config key 'optim\.momentum'"):
        TrainConfig(optim={"momentum": 0.9})


def test_configs_are_frozen_and_replace_validates():
    cfg = TrainConfig()
    with pytest.raises(Exception):
        cfg.total_steps = 3
    assert cfg.replace(optim={"lr": 3e-5}).optim.lr == 3e-5
    assert cfg.replace(optim={"lr": "3e-5"}).optim.lr == 3e-5
    with pytest.raises(ValueError, match="group_size"):
        cfg.replace(rollout={"group_size": 1})
    with pytest.raises(ValueError, match=r"rollout\.temperature"):
        cfg.replace(rollout={"temperature": float("inf")})


# ---- the command line: `qerl train --config x.yaml [--output-dir D]` ---------------------------
class _Built(Exception):
    pass


def _capture_train_config(monkeypatch, argv):
    """Run ``qerl train`` up to the Trainer and return the TrainConfig it would train with."""
    import qerl_kit.build
    import qerl_kit.cli
    import qerl_kit.trainer

    import qerl_kit.tasks

    class FakeTrainer:
        def __init__(self, policy, tokenizer, task, cfg, **kwargs):
            raise _Built(cfg)

    monkeypatch.setattr(qerl_kit.build, "build_policy", lambda mcfg, **kwargs: (None, None, None))
    monkeypatch.setattr(qerl_kit.tasks, "make_task", lambda dcfg: None)
    monkeypatch.setattr(qerl_kit.cli, "torch_cuda_available", lambda: False)
    monkeypatch.setattr(qerl_kit.trainer, "Trainer", FakeTrainer)
    with pytest.raises(_Built) as built:
        qerl_kit.cli.main(argv)
    return built.value.args[0]


def test_cli_train_reads_yaml_strings_with_their_declared_types(tmp_path, monkeypatch):
    path = tmp_path / "run.yaml"
    path.write_text('preset: tiny-cpu\noptim: {lr: 1e-5}\naqn: {enabled: "false"}\n'
                    'filters: {dynamic_sampling: "off"}\n')
    cfg = _capture_train_config(monkeypatch, ["train", "--config", str(path), "--output-dir",
                                              str(tmp_path / "out"), "--no-widgets"])
    assert cfg.optim.lr == 1e-5 and type(cfg.optim.lr) is float
    assert cfg.aqn.enabled is False and cfg.filters.dynamic_sampling is False
    assert cfg.output_dir == str(tmp_path / "out")


def test_cli_train_refuses_a_bad_value_before_building_anything(tmp_path, monkeypatch, capsys):
    import qerl_kit.build
    from qerl_kit.cli import main

    monkeypatch.setattr(qerl_kit.build, "build_policy", lambda *a, **k: pytest.fail("built a model"))
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny-cpu\noptim: {max_grad_norm: -1}\n")
    assert main(["train", "--config", str(path), "--no-widgets"]) == 2  # a refusal, not a traceback
    assert re.search(r"^qerl train: .*run\.yaml: optim\.max_grad_norm must be a finite float >= 1e-06.*got -1$",
                     capsys.readouterr().err)


# ---- SamplingParams (qerl_kit.rollout) ---------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-0.5), "temperature"), (dict(temperature="1.0"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(top_p="0.9"), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=8.0), "max_new_tokens"),
    (dict(top_k=-1), "top_k"), (dict(top_k=False), "top_k"),
    (dict(seed=1.5), "seed"), (dict(seed="abc"), "seed"), (dict(seed=True), "seed"),
])
def test_sampling_params_reject_values_that_sample_wrong(kwargs, match):
    from qerl_kit.rollout import SamplingParams

    with pytest.raises(ValueError, match=rf"^{match} must be .*; got "):
        SamplingParams(**kwargs)


def test_sampling_params_allow_greedy_and_unseeded():
    from qerl_kit.rollout import SamplingParams

    assert SamplingParams(temperature=0).greedy  # 0 means greedy decoding (evaluation)
    assert SamplingParams(seed=None).seed is None and SamplingParams(seed=3).seed == 3
    assert SamplingParams(top_p=1.0, top_k=0, max_new_tokens=1).top_p == 1.0
    assert not math.isnan(SamplingParams(temperature=0.6).temperature)


# ---- the filters' keys live in their section, and the registries the choices come from -------------
def test_a_filter_key_in_the_loss_section_is_an_unknown_key(tmp_path):
    assert from_dict(dict(filters=dict(dynamic_sampling=True), loss=dict(mu=2))).filters.dynamic_sampling is True
    with pytest.raises(ConfigError, match=r"unknown config key 'loss\.dynamic_sampling'; allowed in 'loss'"):
        from_dict(dict(loss=dict(dynamic_sampling=True, mu=2)))
    path = tmp_path / "old.yaml"
    path.write_text("preset: paper-bigmath\nloss:\n  dynamic_sampling: false\n")
    with pytest.raises(ConfigError, match=r"old\.yaml: unknown config key 'loss\.dynamic_sampling'"):
        load_config(path)


def test_a_name_typo_is_answered_with_the_nearest_registered_name():
    with pytest.raises(ConfigError, match=r"model\.format must be one of .*'nf4', 'none' \(did you mean 'nvfp4'\?\); "
                                          r"got 'nvpf4'$"):
        from_dict(dict(model=dict(format="nvpf4")))
    with pytest.raises(ConfigError, match=r"data\.dataset must be one of .* \(did you mean 'countdown'\?\)"):
        from_dict(dict(data=dict(dataset="countdwn")))


def test_choices_are_read_from_the_registries_they_name(monkeypatch):
    from qerl_kit import grpo
    from qerl_kit.rollout import registry
    from qerl_kit.tasks import registry as tasks

    for field, key, value in (("engine", "rollout", "mine"), ("loss", "loss", "mine"), ("dataset", "data", "mine")):
        with pytest.raises(ConfigError, match=f"{key}.{field}"):
            from_dict({key: {field: value}})
    monkeypatch.setitem(registry.ENGINES, "mine", lambda policy, tok, **kw: None)
    monkeypatch.setitem(grpo.LOSSES, "mine", grpo.LossSpec(grpo.grpo_loss, "sequences"))
    monkeypatch.setitem(tasks.TASKS, "mine", lambda cfg, seed: None)
    cfg = from_dict(dict(rollout=dict(engine="mine"), loss=dict(loss="mine"), data=dict(dataset="mine")))
    assert (cfg.rollout.engine, cfg.loss.loss, cfg.data.dataset) == ("mine", "mine", "mine")


def test_nearest_names_the_closest_option_or_nothing():
    from qerl_kit.config_types import nearest

    assert nearest("nvpf4", ("nvfp4", "mxfp4", "nf4")) == "nvfp4"
    assert nearest("qwen2-tyni", ["tiny", "qwen2-tiny"], cutoff=0.75) == "qwen2-tiny"
    assert nearest("zzzz", ("nvfp4", "mxfp4")) is None  # nothing close: no hint
    assert nearest("nvfp4" * 40, ("nvfp4",)) is None  # 200 characters: not compared (difflib is quadratic)
    assert nearest(3, ("3",)) is None  # not a string


def test_model_kernels_names_a_backend_is_resume_neutral_and_sets_the_process_backend_at_build(monkeypatch):
    """model.kernels: null (the process's backend kept) or a kernels.Backend value, refused otherwise with the
    key, the value and the choices; build_policy makes it the process's backend (set_backend); a resume may
    change it (the same products, other rounding)."""
    from qerl_kit import build, kernels
    from qerl_kit.checkpoint import config_changes

    assert ModelConfig().kernels is None and ModelConfig(kernels="ours").kernels == "ours"
    with pytest.raises(ConfigError, match=r"model\.kernels must be null or one of 'auto', 'ours', .*got 'fast'"):
        ModelConfig(kernels="fast")
    a, b = preset("tiny-cpu").to_dict(), preset("tiny-cpu", model=dict(kernels="ours")).to_dict()
    assert config_changes(a, b) == {}
    def stop(cfg, **kw):  # the model never loads: the backend is set before it would
        raise RuntimeError("stop")
    monkeypatch.setattr(build, "load_base", stop)
    before = kernels.get_backend()
    try:
        for value, expect in ((None, before), ("reference", kernels.Backend.REFERENCE)):
            with pytest.raises(RuntimeError, match="stop"):
                build.build_policy(ModelConfig(kernels=value))
            assert kernels.get_backend() is expect
    finally:
        kernels.set_backend(before)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # on the CPU, outside the interpreter
    for value in ("ours", "triton", "humming"):  # GPU kernels forced on the CPU: refused at build, the backend kept
        with pytest.raises(ConfigError, match=rf"model\.kernels must be null, 'auto' or 'reference' on the CPU .*"
                                              rf"got '{value}'"):
            build.build_policy(ModelConfig(kernels=value), device="cpu")
        assert kernels.get_backend() is before
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "humming" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"model\.kernels must be null, 'auto', 'ours', 'triton' or 'reference' here "
                                          r".*humming-kernels is not installed.*got 'humming'"):
        build.check_kernels("humming", "cuda")  # a GPU without humming-kernels: refused before the model loads
    build.check_kernels("ours", "cuda")  # what the GPU takes without it
