"""Inputs checked where they enter, one check per concept (issue #43, "Nothing silently wrong").

Cases 30, 31, 32, 33, 34, 35, 39, 41, 44, 45, 83 (the up-front refusal of lr 1e20), 93, 125, 127 and 128
of ../shared/reference/qa-cases-2026-12-03.md, and the issue's behaviours: sampling parameters, seeds,
step counts, learning rates and AQN sigmas are refused by the same rule whether they come from YAML, the
CLI, a Python call or a widget, with key, value and allowed range; a skip or LoRA target name that matches
nothing lists the names that exist; an error message never prints (or builds) an unbounded value.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

from qerl_kit.aqn import AQN
from qerl_kit.cli import main
from qerl_kit.config import ConfigError, from_dict, load_config
from qerl_kit.formats import FORMATS
from qerl_kit.linear import NVFP4Linear
from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout import HFEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A tiny quantized policy with LoRA and AQN, built once for the trainer's controls."""
    from tests.test_rollout import make_tokenizer
    from tests.test_trainer import TASK, _config, _policy
    from qerl_kit.trainer import Trainer

    return Trainer(_policy(), make_tokenizer(), TASK, _config(tmp_path_factory.mktemp("inputs")), progress="none")


def _yaml(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# ---- quantize_model: skip lists, tied heads, meta tensors, the report's error ------------------------
def test_case_30_tied_lm_head_with_empty_skip_is_refused():
    model = build_model("qwen2-tiny", tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with pytest.raises(ValueError, match=r"lm_head.*shares its weight with the embedding.*tie"):
        quantize_model(model, skip=())
    assert type(model.lm_head) is nn.Linear  # checked before anything was swapped
    assert all(type(m) is not NVFP4Linear for m in model.modules())


def test_case_31_skip_name_matching_nothing_lists_the_layers(capsys):
    model = build_model("qwen2-tiny")
    with pytest.raises(ConfigError, match=r"^skip: 'down_prj' matches no linear layer.*'down_proj'.*'lm_head'") as err:
        quantize_model(model, skip=("lm_head", "down_prj"))
    assert "did you mean 'down_proj'" in str(err.value)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # untouched
    # the CLI goes through the same check: a clear refusal (rc 2), not "kept dense: none"
    assert main(["quantize", "llama-tiny", "--skip", "lm_hed"]) == 2
    out = capsys.readouterr()
    assert "kept dense" not in out.out
    assert "'lm_hed' matches no linear layer" in out.err and "'lm_head'" in out.err


def _linear(scale: float = 1.0, big: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    with torch.no_grad():
        model[0].weight.mul_(scale)
        if big is not None:
            model[0].weight[0, 0] = big
    return model


def test_case_32_rel_error_of_tiny_weights_is_the_true_error():
    report = quantize_model(_linear(scale=1e-30))
    assert 0.05 < report.layers[0].rel_error < 0.15  # the same ~0.1 as at scale 1, not 0.0


def test_case_33_rel_error_with_a_huge_weight_is_finite():
    import math

    report = quantize_model(_linear(big=1e38))
    assert math.isfinite(report.layers[0].rel_error)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_case_34_quantized_linear_refuses_an_integer_input(fmt):
    model = _linear()
    quantize_model(model, fmt=fmt)
    with pytest.raises(TypeError, match=r"floating-point input.*torch\.int64"):
        model[0](torch.ones(2, 64, dtype=torch.long))
    assert model[0](torch.ones(2, 64)).dtype == torch.float32  # a float input still works


def test_case_35_meta_device_model_gets_a_clear_error():
    model = build_model("qwen2-tiny", device="meta")
    with pytest.raises(ValueError, match=r"meta device.*load the weights first"):
        quantize_model(model)


# ---- AQN on a model it cannot probe ------------------------------------------------------------------
@pytest.mark.parametrize("layers", [lambda: [nn.Linear(64, 64)], lambda: [nn.LayerNorm(64), nn.Linear(64, 64)]],
                         ids=["no-parameters", "sequential-with-norm"])
def test_case_39_aqn_on_a_model_without_input_ids_is_a_clear_error(layers):
    model = nn.Sequential(*layers())
    quantize_model(model)
    with pytest.raises(ValueError, match=r"probe forward pass model\(input_ids=\.\.\.\).*Sequential"):
        AQN(total_steps=20).apply(model, 5)


# ---- LoRA targets --------------------------------------------------------------------------------------
def test_case_41_lora_target_matching_nothing_lists_the_layers():
    model = build_model("qwen2-tiny")
    quantize_model(model)
    with pytest.raises(ConfigError, match=r"^targets: 'nonexistent_proj' matches no linear layer.*'q_proj'"):
        attach_lora(model, targets=("q_proj", "nonexistent_proj"))
    with pytest.raises(ConfigError, match=r"'q_prj'.*did you mean 'q_proj'"):
        attach_lora(model, targets=("q_prj",))
    with pytest.raises(ConfigError, match=r"^targets must be a non-empty list of linear layer names"):
        attach_lora(model, targets=())
    with pytest.raises(ConfigError, match=r"^seed must be an int in \[0, 2\*\*63 - 1\]"):
        attach_lora(model, targets=("q_proj",), seed=2**70)
    assert not any("lora_" in name for name, _ in model.named_modules())  # nothing was wrapped


# ---- sampling: temperature and seed ----------------------------------------------------------------
def test_case_44_tiny_temperature_is_refused_up_front_everywhere(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^temperature must be 0 \(greedy\) or a finite float >= 0\.0001.*got 1e-45"):
        SamplingParams(max_new_tokens=4, temperature=1e-45)
    with pytest.raises(ConfigError, match=r"rollout\.temperature must be a finite float >= 0\.0001.*got 1e-45"):
        load_config(_yaml(tmp_path, "rollout: {temperature: 1.0e-45}\n"))
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-4).temperature == 1e-4
    assert main(["eval", "--temperature", "1e-45", "--limit", "1"]) == 2  # before the model loads
    assert "--temperature must be 0 (greedy) or a finite float >= 0.0001" in capsys.readouterr().err
    assert main(["eval", "--top-p", "1.5", "--limit", "1"]) == 2  # the other sampling parameters alike
    assert "--top-p must be a finite float in (0, 1]" in capsys.readouterr().err


def test_case_45_seed_beyond_64_bits_is_refused_up_front():
    with pytest.raises(ValueError, match=r"^seed must be an int in \[0, 2\*\*63 - 1\].*got 1180591620717411303424"):
        SamplingParams(seed=2**70)
    with pytest.raises(ValueError, match=r"^seed must be an int in \[0, 2\*\*63 - 1\]"):
        SamplingParams(seed=-5)
    with pytest.raises(ValueError, match=r"^seed must be an int in \[0, 2\*\*63 - 1\]"):
        AQN(seed=2**70)  # AQN seeds its own torch.Generator with it, by the same rule
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_case_125_token_ids_outside_the_vocabulary_are_named():
    from tests.test_rollout import make_tokenizer

    model = build_model("qwen2-tiny")
    engine = HFEngine(model, make_tokenizer())
    vocab = model.get_input_embeddings().num_embeddings
    for bad in (10**6, -5, vocab):
        with pytest.raises(ValueError, match=rf"prompt 0 has token id {bad}; token ids must be in \[0, {vocab}\)"):
            engine.generate([[bad]], 1, SamplingParams(max_new_tokens=2))


# ---- learning rate, AQN sigma, steps: config, Python, widgets --------------------------------------------
def test_case_83_lr_1e20_is_refused_up_front(tmp_path, trainer):
    with pytest.raises(ConfigError, match=r"optim\.lr must be a finite float in \[1e-09, 1\] \(.*Adam.*\); got 1e\+20"):
        load_config(_yaml(tmp_path, "optim: {lr: 1.0e+20}\n"))
    with pytest.raises(ValueError, match=r"^lr must be a finite float in \[1e-09, 1\]"):
        trainer.set_lr(1e20)  # the dashboard's lr slider goes through set_lr
    assert trainer.optimizer.param_groups[0]["initial_lr"] == 5e-3  # unchanged


@pytest.mark.parametrize("sigma", [1e30, 1e6])
def test_case_127_huge_aqn_sigma_is_refused_everywhere(tmp_path, trainer, sigma):
    with pytest.raises(ConfigError, match=rf"aqn\.sigma_start must be a finite float in \(0, 10\].*got {re.escape(repr(sigma))}"):
        load_config(_yaml(tmp_path, f"aqn: {{sigma_start: {sigma:e}, sigma_end: {sigma / 10:e}}}\n"))
    with pytest.raises(ValueError, match=r"^sigma_start must be a finite float in \(0, 10\]"):
        AQN(sigma_start=sigma, sigma_end=1e-3)
    with pytest.raises(ValueError, match=r"^sigma_start must be a finite float in \(0, 10\]"):
        trainer.aqn.sigma_start = sigma  # the dashboard's sigma slider sets it so
    with pytest.raises(ValueError, match=r"^sigma must be a finite float in \[0, 10\]"):
        trainer.aqn.apply(trainer.model, 0, sigma=sigma)  # the exploration probe's path
    from qerl_kit.widgets.aqn_panel import AQNPanel

    panel = AQNPanel(AQN(total_steps=20))
    with pytest.raises(ValueError, match=r"sigma_start must be a finite float in \(0, 10\]"):
        panel.set(sigma_start=sigma)
    assert trainer.aqn.sigma_start == 1e-2 and panel.aqn.sigma_start == 1e-2  # unchanged


def test_case_128_negative_steps_are_refused_by_every_entry_point(tmp_path, trainer, capsys):
    from qerl_kit.demo import run_demo

    assert main(["train", "--output-dir", str(tmp_path / "r"), "--steps", "-3", "--no-widgets"]) == 2
    assert "--steps must be an int >= 1" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # no untrained checkpoint-0
    step = trainer.step
    for bad in (-3, 0):
        with pytest.raises(ValueError, match=rf"^steps must be an int >= 1 .*got {bad}"):
            trainer.train(bad)
    assert trainer.step == step
    with pytest.raises(ValueError, match=r"^steps must be an int >= 1 .*got -3"):
        run_demo(steps=-3, output_dir=str(tmp_path / "demo"))
    assert not (tmp_path / "demo").exists()


def test_one_rule_per_concept_whatever_the_entry_point(trainer):
    """The config field and the Python entry points state the same allowed range for each concept."""
    def allowed(fn):
        with pytest.raises(ConfigError) as err:
            fn()
        return err.value.allowed

    lr = {allowed(lambda: from_dict({"optim": {"lr": 5.0}})), allowed(lambda: trainer.set_lr(5.0))}
    sigma = {allowed(lambda: from_dict({"aqn": {"sigma_start": 50.0, "sigma_end": 1.0}})),
             allowed(lambda: AQN(sigma_start=50.0, sigma_end=1.0))}
    temp = {allowed(lambda: from_dict({"rollout": {"temperature": 1e-6}})),
            allowed(lambda: SamplingParams(temperature=1e-6)).replace("0 (greedy) or ", "")}
    assert lr == {"a finite float in [1e-09, 1]"} and sigma == {"a finite float in (0, 10]"}
    assert temp == {"a finite float >= 0.0001"}


# ---- bounded error messages ----------------------------------------------------------------------------
LAUGHS = ('[&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"], '
          + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)) + "]")


@pytest.mark.parametrize("text", [f"seed: {LAUGHS}\n", f"output_dir: {LAUGHS}\n", f"optim: {{lr: {LAUGHS}}}\n",
                                  f"preset: {LAUGHS}\n", f"{LAUGHS}\n"],
                         ids=["seed", "output_dir", "optim.lr", "preset", "top-level"])
def test_case_93_yaml_alias_tree_fails_fast_with_a_short_message(tmp_path, text):
    path = _yaml(tmp_path, text)
    assert len(text) < 500
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert time.perf_counter() - start < 2.0  # generous: it takes milliseconds (41 s and a MemoryError before)
    assert len(str(err.value)) < 1500 and "'lol'" in str(err.value)


def test_error_values_are_bounded_whatever_their_type():
    from qerl_kit.config_types import short_repr

    assert short_repr(10**5000) == "<an int of 16610 bits>"
    assert len(short_repr("x" * 10**6)) <= 200 and len(short_repr({str(i): i for i in range(10**5)})) <= 200
    with pytest.raises(ConfigError) as err:
        from_dict({"k" * 10**5: 1})
    assert len(str(err.value)) < 2000
