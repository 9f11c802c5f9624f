"""Round 3 of the export and quantize class (issue #43): the third trial (2026-12-04), rows 1-10.

``save_nvfp4`` refuses a dense dtype that is not floating and a ``max_shard_size`` that is a bool;
``load_nvfp4`` checks every tensor as it reads it (a NaN norm or global scale is named with its
file), reads config.json with errors naming the file and key, and names a truncated weight file;
``finite.check_weights`` checks float8 scales; ``qerl eval`` evaluates an export of ``qerl quantize
--out``; a model directory without a tokenizer, or with a truncated weight file, is refused naming
it; ``qerl quantize --skip`` that leaves a tied head (or nothing) to quantize is one line, status 2;
``quantize_model(fmt=None)`` names the format.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_kit.cli import main
from qerl_kit.export import load_nvfp4, save_nvfp4
from qerl_kit.finite import NonFiniteError, check_weights
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def quantized():
    model = build_model("qwen2-tiny")
    quantize_model(model, fmt="nvfp4")
    return model


@pytest.fixture(scope="module")
def export(quantized, tmp_path_factory):
    """A good export of the quantized tiny preset (copy it before changing it)."""
    return save_nvfp4(quantized, tmp_path_factory.mktemp("r3export") / "good")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A private copy of the shipped tiny model directory (qerl_kit/assets/tiny-arith)."""
    from qerl_kit.tiny import TINY_DIR

    path = tmp_path_factory.mktemp("r3src") / "src"
    shutil.copytree(TINY_DIR, path)
    return path


def _copy(export, tmp_path, name="copy"):
    out = tmp_path / name
    shutil.copytree(export, out)
    return out


def _one_line_rc2(capsys, argv, *words):
    """``qerl argv`` exits with status 2 and one stderr line holding every one of ``words``."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = next((x for x in err if x.startswith("qerl ")), "")
    assert "Traceback" not in "\n".join(err)
    for word in words:
        assert word in line, (word, err)
    return line


# ---- save_nvfp4's arguments -------------------------------------------------------------------------
def test_r3_01_int8_dtype_is_refused(quantized, tmp_path):
    """save_nvfp4(m, "ex/dint", dtype=torch.int8): the dense tensors must be float."""
    with pytest.raises(ValueError, match=r"dtype must be a floating dtype.*torch.int8"):
        save_nvfp4(quantized, tmp_path / "dint", dtype=torch.int8)
    assert not (tmp_path / "dint").exists()  # refused before a byte is written
    with pytest.raises(ValueError, match=r"dtype must be a floating dtype.*'bf16'"):  # a name, not a dtype
        save_nvfp4(quantized, tmp_path / "dstr", dtype="bf16")


def test_r3_01_load_nvfp4_refuses_an_int_dtype_too(export):
    """load_nvfp4(d, dtype=torch.int8): the same rule for the dense tensors loaded."""
    with pytest.raises(ValueError, match=r"dtype must be a floating dtype.*torch.int8"):
        load_nvfp4(export, dtype=torch.int8)


def test_r3_02_bool_shard_size_is_refused(quantized, tmp_path):
    """save_nvfp4(m, d, max_shard_size=True): a bool is not a size (it was taken as 1 byte: 55 shards)."""
    with pytest.raises(ValueError, match=r"max_shard_size must be an int .*True"):
        save_nvfp4(quantized, tmp_path / "st", max_shard_size=True)
    assert not (tmp_path / "st").exists()


# ---- load_nvfp4 reads what it loads with checks --------------------------------------------------
@pytest.mark.parametrize("suffix", ["input_layernorm.weight", "weight_global_scale", "weight_scale"])
def test_r3_03_nan_tensor_in_an_export_is_named(export, tmp_path, suffix):
    """export, then one input_layernorm.weight value (or one weight_global_scale, or one fp8 block
    scale) NaN in model.safetensors, then load_nvfp4(d)."""
    d = _copy(export, tmp_path)
    tensors = load_file(d / "model.safetensors")
    key = next(k for k in tensors if k.endswith(suffix))
    if tensors[key].dtype == torch.float8_e4m3fn:
        tensors[key].view(torch.uint8).view(-1)[0] = 0x7F  # the E4M3 NaN
    else:
        tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteError) as err:
        load_nvfp4(d)
    assert key in str(err.value) and str(d / "model.safetensors") in str(err.value)


def _config_refused(export, tmp_path, edit, match):
    """A copy of the export whose config.json text ``edit`` rewrote: ``load_nvfp4`` refuses it with a
    ValueError matching ``match`` and naming the file."""
    d = _copy(export, tmp_path)
    (d / "config.json").write_text(edit((d / "config.json").read_text()))
    with pytest.raises(ValueError, match=match) as err:
        load_nvfp4(d)
    assert str(d / "config.json") in str(err.value)


def _with(**changes):
    return lambda text: json.dumps({**json.loads(text), **changes})


def test_r3_04_bad_json_config_is_named(export, tmp_path):
    """export, then config.json = `{not json`, then load_nvfp4(d)."""
    _config_refused(export, tmp_path, lambda _: "{not json", "not valid JSON")


def test_r3_05_negative_vocab_size_is_named(export, tmp_path):
    """export, then "vocab_size": -1 in config.json, load_nvfp4(d)."""
    _config_refused(export, tmp_path, _with(vocab_size=-1), "vocab_size must be a positive int; got -1")


def test_r3_05_a_config_no_model_can_have_names_the_file(export, tmp_path):
    """export, then "hidden_act": "nope" in config.json: transformers' own refusal, with the file."""
    _config_refused(export, tmp_path, _with(hidden_act="nope"), "describes no model transformers can build")


def test_r3_08_truncated_export_is_named(export, tmp_path):
    """export, then model.safetensors cut to 1000 bytes, load_nvfp4(d)."""
    d = _copy(export, tmp_path)
    with open(d / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match="damaged or truncated") as err:
        load_nvfp4(d)
    assert str(d / "model.safetensors") in str(err.value)


# ---- an export is a model qerl can use ----------------------------------------------------------
def test_r3_06_check_weights_reads_float8_scales(quantized):
    """check_weights on a model holding float8 block scales (it raised NotImplementedError 'isfinite'
    for Float8_e4m3fn); a NaN scale is named."""
    check_weights(quantized, "the quantized preset")  # finite: passes
    layer = quantized.model.layers[1].mlp.up_proj
    saved = layer.scales.clone()
    try:
        layer.scales.view(torch.uint8).view(-1)[3] = 0x7F  # one NaN E4M3 scale
        with pytest.raises(NonFiniteError, match=r"layers\.1\.mlp\.up_proj\.scales"):
            check_weights(quantized, "the quantized preset")
    finally:
        layer.scales.copy_(saved)


def test_r3_06_eval_runs_on_an_export_of_qerl_quantize(src, tmp_path, capsys):
    """qerl quantize src --out q1, then qerl eval --model q1 --limit 2 --max-new-tokens 4."""
    q1 = tmp_path / "q1"
    assert main(["quantize", str(src), "--out", str(q1)]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(q1), "--limit", "2", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert "qerl eval: 2 arith problems" in capsys.readouterr().out
    # another format than the export's is one line, not a second quantization
    _one_line_rc2(capsys, ["eval", "--model", str(q1), "--limit", "1", "--format", "nf4", "--device", "cpu"],
                  "--format nf4", "already quantized to nvfp4")


def test_training_on_an_export_in_another_format_is_the_same_refusal_as_eval(src, tmp_path):
    """build_policy and qerl eval share quantize_base: an NVFP4 export asked for nf4 is a ConfigError
    naming the key, not quantize_model's ValueError (which qerl train printed as a traceback)."""
    from qerl_kit.build import build_policy
    from qerl_kit.config import ModelConfig
    from qerl_kit.config_types import ConfigError

    q1 = tmp_path / "q1"
    assert main(["quantize", str(src), "--out", str(q1)]) == 0
    with pytest.raises(ConfigError, match=r"model\.format nf4: model .*q1 is already quantized to nvfp4; "
                                          r"use model\.format nvfp4"):
        build_policy(ModelConfig(name=str(q1), format="nf4"))
    policy, _, report = build_policy(ModelConfig(name=str(q1), format="nvfp4"))
    assert report is None  # used as it loads, not quantized twice


def test_r3_07_model_dir_without_tokenizer_is_refused(src, tmp_path, capsys):
    """A model folder without tokenizer.json/tokenizer_config.json; qerl quantize notok --out q_notok,
    and qerl eval --model notok."""
    notok = tmp_path / "notok"
    shutil.copytree(src, notok, ignore=shutil.ignore_patterns("tokenizer*"))
    _one_line_rc2(capsys, ["quantize", str(notok), "--out", str(tmp_path / "q_notok")], "no tokenizer", str(notok))
    assert not (tmp_path / "q_notok").exists()
    _one_line_rc2(capsys, ["eval", "--model", str(notok), "--limit", "1", "--device", "cpu"], "no tokenizer",
                  str(notok))


def test_r3_08_truncated_model_file_is_one_line(src, tmp_path, capsys):
    """truncated model.safetensors (1000 bytes); qerl quantize trunc."""
    trunc = tmp_path / "trunc"
    shutil.copytree(src, trunc)
    with open(trunc / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    _one_line_rc2(capsys, ["quantize", str(trunc)], str(trunc / "model.safetensors"), "truncated")


@pytest.mark.parametrize("skip", [["mlp"], []])
def test_r3_09_skip_that_leaves_the_tied_head_is_one_line(src, capsys, skip):
    """qerl quantize src --skip mlp (or a bare --skip): --skip replaces the default lm_head."""
    _one_line_rc2(capsys, ["quantize", str(src), "--skip", *skip], "lm_head", "tied", "add lm_head")


def test_r3_09_skip_that_leaves_nothing_is_one_line(src, capsys):
    """qerl quantize src --skip mlp self_attn lm_head."""
    _one_line_rc2(capsys, ["quantize", str(src), "--skip", "mlp", "self_attn", "lm_head"],
                  "no nn.Linear layers to convert", "keeps every one of them dense")


def test_r3_10_format_none_is_named():
    """quantize_model(build_model("qwen2-tiny"), fmt=None)."""
    with pytest.raises(ValueError, match=r"unknown weight format None; choose one of \['mxfp4', 'nf4', 'nvfp4'\]"):
        quantize_model(build_model("qwen2-tiny"), fmt=None)
