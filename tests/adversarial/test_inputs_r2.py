"""Round 2 of the inputs class (issue #43): config, YAML and CLI values that still went wrong.

Rows 1-13, 19, 40 and 41 of the second trial (2026-12-04): YAML files
are read strictly (a key or section given twice, a tab in the indentation, an int too long for
Python to read: each a ``ConfigError`` naming ``file:line``); values that cannot work are refused
by their one rule where they enter (lr and max_grad_norm too small to move the adapter, weight
decay, KL weight, overlong penalty and LoRA alpha so large they blow up, mu and batch sizes that
never finish or never fit, data sizes a generated task cannot make); training past total_steps on
a schedule that has reached lr 0 is refused; seeds from Python use the seed rule; ``qerl eval`` and
``qerl quantize`` flags are refused before the model loads, in one line with status 2.
"""

from __future__ import annotations

import pytest

from qerl_kit.cli import main
from qerl_kit.config import DataConfig, from_dict, load_config, preset
from tests.adversarial._refusals import refused as _refused

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _yaml(tmp_path, text: str, name: str = "cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path




class _Loaded(Exception):
    """Raised by a spy where a model (or the task's data) would start loading: a flag was not checked first."""


def _forbid(monkeypatch, *targets):
    def spy(*args, **kwargs):
        raise _Loaded("reached " + ", ".join(targets))
    for target in targets:
        monkeypatch.setattr(target, spy)


# ---- YAML read strictly ---------------------------------------------------------------------------------
def test_r2_01_section_given_twice_is_refused(tmp_path):
    """preset: tiny-cpu / optim: {lr: 1.0e-3} / rollout: {batch_size: 8} / optim: {max_grad_norm: 0.5}"""
    path = _yaml(tmp_path, "preset: tiny-cpu\noptim: {lr: 1.0e-3}\nrollout: {batch_size: 8}\n"
                           "optim: {max_grad_norm: 0.5}\n")
    _refused(lambda: load_config(path), f"{path}:4:1: optim is given twice (first on line 2)")


def test_r2_02_key_given_twice_in_a_mapping_is_refused(tmp_path):
    """optim:\\n  lr: 1.0e-3\\n  lr: 0.5"""
    path = _yaml(tmp_path, "preset: tiny-cpu\noptim:\n  lr: 1.0e-3\n  lr: 0.5\n")
    _refused(lambda: load_config(path), f"{path}:4:3: optim.lr is given twice (first on line 3)")
    # nested deeper and at the top level too
    path = _yaml(tmp_path, "seed: 1\ntotal_steps: 10\nseed: 2\n", "top.yaml")
    _refused(lambda: load_config(path), f"{path}:3:1: seed is given twice")


def test_r2_03_tab_indent_is_one_line_naming_file_and_line(tmp_path, capsys, monkeypatch):
    """A YAML indented with a tab, `qerl train --config`."""
    path = _yaml(tmp_path, "preset: tiny-cpu\noptim:\n\tlr: 1.0e-3\n")
    _forbid(monkeypatch, "qerl_kit.build.build_policy")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qerl train: {path}:3:1: not valid YAML") and "tab" in err
    assert err.count("\n") == 1 and "Traceback" not in err and "<unicode string>" not in err


def test_r2_04_int_of_5000_digits_names_key_and_file(tmp_path):
    """total_steps: followed by a 5000-digit integer."""
    path = _yaml(tmp_path, "preset: tiny-cpu\ntotal_steps: " + "9" * 5000 + "\n")
    msg = _refused(lambda: load_config(path), f"{path}:2:14: total_steps must be an int of at most", "5000 digits")
    assert len(msg) < 400
    # inside a section, the dotted key; a huge int given from Python is printed by its size, never in full
    path = _yaml(tmp_path, "optim: {lr: " + "1" * 5000 + "}\n", "lr.yaml")
    _refused(lambda: load_config(path), f"{path}:1:13: optim.lr must be an int of at most")
    msg = _refused(lambda: from_dict({"seed": 10**5000}), "seed must be an int in [0, 2**32 - 1]", "<an int of")
    assert len(msg) < 400


# ---- ranges that can work ---------------------------------------------------------------------------------
def test_r2_05_lr_too_small_to_move_the_adapter_is_refused():
    """optim: {lr: 1.0e-300}"""
    _refused(lambda: preset("tiny-cpu", optim={"lr": 1e-300}), "optim.lr must be a finite float in [1e-09, 1]",
             "got 1e-300")
    assert preset("tiny-cpu", optim={"lr": 1e-9}).optim.lr == 1e-9  # the bound itself is allowed


def test_r2_06_max_grad_norm_too_small_is_refused():
    """optim: {max_grad_norm: 1.0e-300}"""
    _refused(lambda: preset("tiny-cpu", optim={"max_grad_norm": 1e-300}),
             "optim.max_grad_norm must be a finite float >= 1e-06", "eps", "got 1e-300")
    assert preset("tiny-cpu", optim={"max_grad_norm": 1e-6}).optim.max_grad_norm == 1e-6


def test_r2_07_huge_weight_decay_is_refused():
    """optim: {weight_decay: 1.0e+30}"""
    _refused(lambda: preset("tiny-cpu", optim={"weight_decay": 1e30}),
             "optim.weight_decay must be a finite float in [0, 1]", "1 - lr x weight_decay", "got 1e+30")
    assert preset("tiny-cpu", optim={"weight_decay": 0.1}).optim.weight_decay == 0.1


def test_r2_08_huge_kl_weight_names_loss_beta():
    """loss: {beta: 1.0e+300}"""
    _refused(lambda: preset("tiny-cpu", loss={"beta": 1e300}), "loss.beta must be a finite float in [0, 10]",
             "got 1e+300")
    assert preset("tiny-cpu", loss={"beta": 0.04}).loss.beta == 0.04


def test_r2_09_huge_overlong_penalty_names_the_key(tmp_path):
    """filters: {overlong_buffer: 4, overlong_penalty: 1.0e+300}"""
    path = _yaml(tmp_path, "preset: tiny-cpu\nfilters: {overlong_buffer: 4, overlong_penalty: 1.0e+300}\n")
    _refused(lambda: load_config(path), str(path), "filters.overlong_penalty must be a finite float in [0, 100]")


def test_r2_10_huge_lora_alpha_is_refused_for_config_and_python():
    """model: {lora_alpha: 1.0e+300}"""
    from qerl_kit.config_types import check_lora_alpha

    _refused(lambda: preset("tiny-cpu", model={"lora_alpha": 1e300}),
             "model.lora_alpha must be null or a finite float in (0, 16000] (1000 x model.lora_r = 16)", "got 1e+300")
    assert preset("tiny-cpu", model={"lora_alpha": 32}).model.lora_alpha == 32.0
    # the same rule for a Python caller (attach_lora's alpha)
    _refused(lambda: check_lora_alpha("alpha", 1e5, 4), "alpha must be null or a finite float in (0, 4000]")
    _refused(lambda: check_lora_alpha("alpha", 0, 4), "alpha must be")
    assert check_lora_alpha("alpha", None, 4) is None and check_lora_alpha("alpha", "8", 4) == 8.0


def test_r2_11_mu_has_an_upper_bound():
    """loss: {mu: 1000000000}"""
    _refused(lambda: preset("tiny-cpu", loss={"mu": 10**9}), "loss.mu must be an int in [1, 64]", "got 1000000000")
    assert preset("tiny-cpu", loss={"mu": 4}).loss.mu == 4


def test_r2_12_batch_that_cannot_fit_names_the_keys():
    """rollout: {group_size: 1000000000, batch_size: 1000000000}"""
    _refused(lambda: preset("tiny-cpu", rollout={"group_size": 10**9, "batch_size": 10**9}),
             "rollout.batch_size must be an int in [1, 1048576]", "rollout.group_size", "got 1000000000")
    _refused(lambda: preset("tiny-cpu", rollout={"group_size": 10**9}), "rollout.group_size must be an int in [2, 1048576]")
    # rows that fit, but not at this length: both keys named
    _refused(lambda: preset("tiny-cpu", rollout={"max_new_tokens": 10**9}),
             "rollout.batch_size x rollout.max_new_tokens must be <= 2**28 tokens per step", "got 64 x 1000000000")
    assert preset("paper-bigmath").rollout.batch_size == 128  # the paper's 128 x 8192 tokens fit


def test_r2_13_data_sizes_a_generated_task_cannot_make_are_refused_at_once(monkeypatch, capsys):
    """make_task(DataConfig(dataset="arith", eval_size=10**12)); qerl eval --limit 100000000 --max-new-tokens 4"""
    _refused(lambda: DataConfig(dataset="arith", eval_size=10**12), "data.eval_size must be an int in [1, 1000000]")
    _refused(lambda: DataConfig(dataset="arith", train_size=10**12), "data.train_size must be an int in [1, 1000000]")
    _forbid(monkeypatch, "qerl_kit.tasks.make_task", "qerl_kit.build.load_base")
    assert main(["eval", "--limit", "100000000", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl eval: --limit must be an int in [1, 1000000]") and err.count("\n") == 1
    # without --limit a generated task is scored on data.eval_size's default, not 10**9 rows that never end
    asked = []

    def spy(cfg, seed=0):
        asked.append(cfg.eval_size)
        raise _Loaded("make_task")
    monkeypatch.setattr("qerl_kit.tasks.make_task", spy)
    with pytest.raises(_Loaded):
        main(["eval", "--max-new-tokens", "4"])
    assert asked == [DataConfig().eval_size]


# ---- steps past total_steps on a decaying schedule -------------------------------------------------------
@pytest.fixture(scope="module")
def policy():
    from tests.test_trainer import _policy

    return _policy()


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_r2_19_steps_past_total_steps_at_lr_0_are_refused(policy, tmp_path, schedule):
    """trainer.train(8) with total_steps 4 and a linear/cosine schedule."""
    from tests.test_rollout import make_tokenizer
    from tests.test_trainer import TASK, _config
    from qerl_kit.trainer import Trainer

    cfg = _config(tmp_path, optim={"schedule": schedule}, total_steps=4)
    trainer = Trainer(policy, make_tokenizer(), TASK, cfg, progress="none")
    _refused(lambda: trainer.train(8), "steps must be at most 4 (this run is at step 0 of total_steps = 4)",
             f"steps 5..8 would run at lr 0: the {schedule} schedule", "raise total_steps", "got 8")
    assert trainer.step == 0 and trainer.history == []  # refused before any step ran
    trainer.step = 4  # a run at its end: one more step would be at lr 0; train() runs what is left (nothing)
    _refused(lambda: trainer.train(1), "steps 5..5 would run at lr 0")
    assert trainer.train().step == 4


def test_r2_19_constant_schedule_may_run_past_total_steps(tmp_path):
    """A constant lr stays the same past total_steps: more steps are allowed (only a schedule at lr 0 is refused)."""
    from qerl_kit.optim import steps_to_run

    cfg = _config_only(tmp_path, "constant")
    assert steps_to_run("steps", cfg, 4, 8) == 8 and steps_to_run("steps", cfg, 1, None) == 3
    assert steps_to_run("steps", _config_only(tmp_path, "cosine"), 1, 3) == 3  # up to total_steps: fine


def _config_only(tmp_path, schedule):
    from tests.test_trainer import _config

    return _config(tmp_path, optim={"schedule": schedule}, total_steps=4)


def test_r2_19_cli_steps_past_total_steps_refused_before_loading(tmp_path, capsys, monkeypatch):
    """qerl train --config cos4.yaml --steps 7 --fresh (linear schedule, total_steps 4)."""
    path = _yaml(tmp_path, "preset: tiny-cpu\nrollout: {batch_size: 4, group_size: 2, max_new_tokens: 8}\n"
                           f"optim: {{schedule: linear}}\ntotal_steps: 4\naqn: {{stages: 3}}\nsave_every: 0\n"
                           f"output_dir: {tmp_path / 'run'}\n")
    _forbid(monkeypatch, "qerl_kit.build.build_policy")
    assert main(["train", "--config", str(path), "--steps", "7", "--fresh"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl train: --steps must be at most 4") and "steps 5..7 would run at lr 0" in err
    assert err.count("\n") == 1


# ---- seeds from Python --------------------------------------------------------------------------------------
def test_r2_40_build_model_seed_uses_the_seed_rule():
    """build_model("qwen2-tiny", seed=2**70); seed=-1 was accepted."""
    from qerl_kit.build import build_policy
    from qerl_kit.config import ModelConfig
    from qerl_kit.models import build_model

    _refused(lambda: build_model("qwen2-tiny", seed=2**70), "seed must be an int in [0, 2**63 - 1]")
    _refused(lambda: build_model("qwen2-tiny", seed=-1), "seed must be an int in [0, 2**63 - 1]", "got -1")
    _refused(lambda: build_policy(ModelConfig(), seed=-1), "seed must be an int in [0, 2**63 - 1]")


# ---- CLI flags refused before the model loads -----------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--samples", "0"], "--samples must be an int >= 1"),
    (["--batch-size", "0"], "--batch-size must be null or an int >= 1"),
    (["--batch-size", "-1"], "--batch-size must be null or an int >= 1"),
    (["--device", "gpu"], "--device gpu: not a device; use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device cuda:x: not a device"),
])
def test_r2_41_eval_flags_refused_before_loading(args, words, capsys, monkeypatch):
    """qerl eval --samples 0 / --batch-size 0/-1 / --device gpu."""
    _forbid(monkeypatch, "qerl_kit.tasks.make_task", "qerl_kit.build.load_base")
    assert main(["eval", "--limit", "2", "--max-new-tokens", "4", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl eval: ") and words in err and err.count("\n") == 1


@pytest.mark.parametrize("size", ["banana", "0", "9" * 400 + "TB"])
def test_r2_41_quantize_shard_size_refused_before_loading(size, tmp_path, capsys, monkeypatch):
    """qerl quantize qwen2-tiny --shard-size banana/0 --out DIR."""
    _forbid(monkeypatch, "qerl_kit.models.build_model", "qerl_kit.models.load_pretrained")
    assert main(["quantize", "qwen2-tiny", "--shard-size", size, "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl quantize: --shard-size must be a positive size in bytes such as 2GB")
    assert err.count("\n") == 1 and len(err) < 400
    assert not (tmp_path / "q").exists()
