"""Configs: presets, YAML round trip, and clear errors for unknown keys and impossible values."""

import pytest

from qerl_kit.config import PRESETS, TrainConfig, from_dict, load_config, preset, save_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_round_trip_through_yaml(name, tmp_path):
    cfg = preset(name)
    path = tmp_path / "c.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg


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


@pytest.mark.parametrize("bad, match", [
    (dict(rollout=dict(group_size=1)), "group_size must be >= 2"),
    (dict(rollout=dict(batch_size=20, group_size=8)), "multiple of rollout.group_size"),
    (dict(learning_rate=1e-5), r"unknown config key\(s\): \['learning_rate'\]"),
    (dict(optim=dict(lr=1e-5, momentum=0.9)), r"section 'optim': \['momentum'\]"),
    (dict(loss=dict(loss="ppo")), "grpo, dapo or dr_grpo"),
    (dict(aqn=dict(stages=2)), "aqn.stages must be >= 3"),
    (dict(total_steps=5), "at least aqn.stages"),
    (dict(model=dict(format="int3")), "model.format"),
    (dict(optim=dict(lr=0)), "optim.lr must be > 0"),
])
def test_impossible_values_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        from_dict(bad)


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(ValueError, match="broken.yaml.*group_size"):
        load_config(path)


def test_configs_are_frozen_and_replace_validates():
    cfg = TrainConfig()
    with pytest.raises(Exception):
        cfg.total_steps = 3
    assert cfg.replace(optim={"lr": 3e-5}).optim.lr == 3e-5
    with pytest.raises(ValueError, match="group_size"):
        cfg.replace(rollout={"group_size": 1})
