"""Tests for ``qerl_kit.gguf_model``: llama.cpp GGUF files loaded as dense Hugging Face models.

A tiny random Qwen2 model and the shipped tiny tokenizer are written to a GGUF file here (F32
tensors, llama.cpp's tensor names and metadata keys, via ``gguf.GGUFWriter``) and loaded back:
the logits, the tokenizer's ids and chat template, the tied/untied head and the plain-``nn.Linear``
layers must survive the round trip, also through ``qerl_kit.models.load_pretrained``/``load_model``.
Then the refusals (missing, not GGUF, truncated, unsupported architecture; ``check_model_source``'s
errors), the chat template's turn end as a stop id, and the real Qwen2.5 GGUF's tokenizer (skipped
when that file is not here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from qerl_kit.finite import NonFiniteError
from qerl_kit.gguf_model import GGUFError, add_turn_end, inspect_gguf, load_gguf
from qerl_kit.models import build_model, check_model_source, load_model, load_pretrained
from qerl_kit.rollout.base import chat_stop_ids, special_ids

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_TOKENIZER = Path(__file__).resolve().parents[1] / "qerl_kit" / "assets" / "tiny-arith"
SAMPLE = "What is 12+30?<|end|>\n  It is 42, ok <|assistant|>done."
REAL_GGUF = Path(os.environ.get("QERL_REAL_MODEL") or
                 Path.home() / ".cache" / "qerl-models" / "qwen2.5-coder-0.5b-instruct.gguf").expanduser()


def write_tiny_gguf(path, model, tokenizer, *, tied: bool = False) -> Path:
    """Write a Qwen2 ``model`` (float32) and byte-level BPE ``tokenizer`` as llama.cpp would: F32
    tensors under GGUF names, the vocabulary padded to the model's with ``[PADi]`` (UNUSED) tokens,
    special tokens as CONTROL. ``tied``: leave out ``output.weight`` (the head is the embedding)."""
    cfg, path = model.config, Path(path)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
    types = [gguf.TokenType.UNUSED] * cfg.vocab_size
    special = set(tokenizer.all_special_ids)
    for token, i in tokenizer.get_vocab().items():
        tokens[i] = token
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    else:  # no merges to write (gguf-py drops an empty array): transformers rebuilds them from scores
        writer.add_token_scores([0.0] * cfg.vocab_size)
    for name, add in (("eos", writer.add_eos_token_id), ("bos", writer.add_bos_token_id),
                      ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if getattr(tokenizer, f"{name}_token_id") is not None:
            add(getattr(tokenizer, f"{name}_token_id"))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.detach().float().numpy().copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def randomize(model, seed: int):
    """Fresh random values for every parameter (biases too; norms around 1), seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "norm" in name else 0.0))
    return model


def tiny_source(*, tied: bool = False, seed: int = 0):
    """A random tiny Qwen2 whose eps and rope base differ from the defaults, so the logits check
    also covers the metadata the loader rebuilds the config from."""
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    model = build_model("qwen2-tiny", seed=seed, tie_word_embeddings=tied, rms_norm_eps=1e-5, rope_parameters=rope)
    return randomize(model, seed + 100)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def tiny_tok():
    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, 512, (3, 11), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, tiny_tok):
    """(source model, path) of an untied tiny GGUF."""
    model = tiny_source()
    return model, write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf", model, tiny_tok)


def test_tiny_gguf_round_trips_logits_tokenizer_and_template(tiny_file, tiny_tok, batch, tmp_path):
    source, path = tiny_file
    model, tok = load_gguf(path, dtype=torch.float32)
    torch.testing.assert_close(logits(model, batch), logits(source, batch), rtol=1e-5, atol=1e-5)
    assert tok(SAMPLE)["input_ids"] == tiny_tok(SAMPLE)["input_ids"]
    assert tok.decode(tiny_tok(SAMPLE)["input_ids"]) == SAMPLE
    assert tok.chat_template == tiny_tok.chat_template
    assert tok.eos_token == "<|end|>" and tok.pad_token_id == tiny_tok.pad_token_id
    info = model.gguf_info
    assert (info.architecture, info.name, info.tied_head) == ("qwen2", "tiny-qwen2", False)
    assert info.tensor_types == {"F32": len(source.state_dict())} and info.size_bytes == path.stat().st_size
    assert model.dtype == torch.float32 and not model.training
    projections = [m for n, m in model.named_modules() if n.endswith(("_proj", "lm_head"))]
    assert len(projections) == 2 * 7 + 1 and all(type(m) is nn.Linear for m in projections)
    assert getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False)
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    again = load_model(str(tmp_path / "saved"), dtype=torch.float32)
    torch.testing.assert_close(logits(again, batch), logits(source, batch), rtol=1e-5, atol=1e-5)


def test_a_load_parses_the_file_once_and_leaves_gguf_as_it_was(tiny_file, tmp_path, monkeypatch):
    """transformers builds a GGUFReader for the tokenizer, the config and the weights; inside load_gguf
    they share one parse per file (one_parse), and gguf.GGUFReader is the plain class again after it."""
    from qerl_kit import gguf_model

    plain, parsed = gguf.GGUFReader, []

    class Counting(plain):
        def __init__(self, path, mode="r"):
            parsed.append(os.path.realpath(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    _, path = tiny_file
    model, _ = load_gguf(path, dtype=torch.float32)
    assert parsed == [os.path.realpath(path)] and gguf.GGUFReader is Counting
    assert model.gguf_info.path == path
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    with gguf_model.one_parse():  # another file gets its own reader; the same file, the same one
        a, b, c = gguf.GGUFReader(path), gguf.GGUFReader(str(path)), gguf.GGUFReader(other)
        assert a is b and a is not c and isinstance(a, plain)
        assert list(a.fields) == list(c.fields)
    assert gguf.GGUFReader is Counting and parsed[1:] == [os.path.realpath(path), os.path.realpath(other)]


def test_load_time_times_both_modes_in_turns_and_restores_one_parse(tiny_file, capsys):
    from bench import real_model
    from qerl_kit import gguf_model

    shared = gguf_model.one_parse
    rows = real_model.load_time(str(tiny_file[1]), 2)
    assert [(r["round"], r["mode"]) for r in rows] == [(0, "one parse"), (0, "a parse per reader"),
                                                       (1, "a parse per reader"), (1, "one parse")]
    assert all(r["seconds"] > 0 for r in rows) and gguf_model.one_parse is shared
    assert "| one parse | " in capsys.readouterr().out


def test_tiny_gguf_loads_through_qerl_kit_models(tiny_file, tiny_tok, batch):
    source, path = tiny_file
    assert check_model_source(str(path)) == "gguf"
    model, tok = load_pretrained(str(path))  # dtype "auto": bf16
    assert model.dtype == torch.bfloat16 and model.gguf_info.path == path
    assert tok(SAMPLE)["input_ids"] == tiny_tok(SAMPLE)["input_ids"]
    torch.testing.assert_close(model.model.embed_tokens.weight, source.model.embed_tokens.weight.bfloat16())
    model32, _ = load_pretrained(str(path), dtype=torch.float32)
    torch.testing.assert_close(logits(model32, batch), logits(source, batch), rtol=1e-5, atol=1e-5)
    plain = load_model(str(path), dtype=torch.float32)
    torch.testing.assert_close(logits(plain, batch), logits(source, batch), rtol=1e-5, atol=1e-5)


def test_file_without_output_weight_loads_with_tied_head(tmp_path, tiny_tok, batch):
    source = tiny_source(tied=True, seed=1)
    assert source.lm_head.weight.data_ptr() == source.model.embed_tokens.weight.data_ptr()
    path = write_tiny_gguf(tmp_path / "tied.gguf", source, tiny_tok, tied=True)
    assert inspect_gguf(path).tied_head is True
    model, _ = load_gguf(path, dtype=torch.float32)
    assert model.gguf_info.tied_head is True and model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(logits(model, batch), logits(source, batch), rtol=1e-5, atol=1e-5)


def test_a_gguf_file_with_a_nan_weight_is_refused_by_load_gguf_naming_it(tmp_path, tiny_tok):
    """load_gguf itself checks the weights, so every caller (load_pretrained, load_model, the bench
    scripts) gets the refusal, naming the tensor and the file."""
    source = tiny_source(seed=2)
    with torch.no_grad():
        source.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    path = write_tiny_gguf(tmp_path / "nan.gguf", source, tiny_tok)
    with pytest.raises(NonFiniteError, match=r"layers\.1\.mlp\.down_proj\.weight.*nan\.gguf|nan\.gguf.*layers\.1\.mlp\.down_proj"):
        load_gguf(path, dtype=torch.float32)


def test_file_with_output_weight_loads_untied(tiny_file):
    source, path = tiny_file
    assert not torch.equal(source.lm_head.weight, source.model.embed_tokens.weight)
    model, _ = load_gguf(path, dtype=torch.float32)
    assert model.gguf_info.tied_head is False and model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.lm_head.weight, source.lm_head.weight, rtol=0, atol=0)


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        load_gguf(missing)
    assert str(missing) in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        check_model_source(str(missing))
    assert str(missing) in str(err.value)


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04" + os.urandom(2048))
    with pytest.raises(GGUFError, match="not a GGUF file") as err:
        load_gguf(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("where", ["tail", "header", "start"])
def test_truncated_file_is_refused(tiny_file, tmp_path, where):
    data = tiny_file[1].read_bytes()
    # 300: inside the vocabulary's strings; 30: before the architecture key
    cut = {"tail": data[:-1000], "header": data[:300], "start": data[:30]}[where]
    path = tmp_path / f"cut-{where}.gguf"
    path.write_bytes(cut)
    # check_model_source reads the first header fields only (milliseconds): a cut in the tensor data
    # passes it and is refused when the file is inspected or loaded
    calls = (inspect_gguf, load_gguf) + ((check_model_source,) if where == "start" else ())
    for call in calls:
        with pytest.raises(GGUFError, match="truncated|damaged") as err:
            call(str(path))
        assert str(path) in str(err.value)
    if where != "start":
        assert check_model_source(str(path)) == "gguf"


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_unsupported_architecture_lists_supported_ones(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for call in (load_gguf, check_model_source):
        with pytest.raises(GGUFError) as err:
            call(str(path))
        message = str(err.value)
        assert str(path) in message and repr(arch) in message
        assert all(name in message for name in ("qwen2", "qwen3", "llama"))


def test_check_model_source_errors_name_the_value(tmp_path, monkeypatch):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json") as err:
        check_model_source(str(empty))
    assert str(empty) in str(err.value)
    (empty / "config.json").write_text("{}")
    assert check_model_source(str(empty)) == "dir"

    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"not a \.gguf file") as err:
        check_model_source(str(weights))
    assert str(weights) in str(err.value)

    monkeypatch.chdir(tmp_path)  # so "org/name" cannot be a local folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE") as err:
        check_model_source("no-such-org/no-such-model")
    assert "'no-such-org/no-such-model'" in str(err.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert check_model_source("no-such-org/no-such-model") == "hub"


def test_chat_turn_end_becomes_a_stop_id(tiny_file, tiny_tok):
    end = tiny_tok.convert_tokens_to_ids("<|end|>")
    assert chat_stop_ids(tiny_tok) == [end]

    model = build_model("qwen2-tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER))
    tok.eos_token = "<|system|>"  # an EOS that is not the turn end: <|end|> must come from the template
    system = tok.convert_tokens_to_ids("<|system|>")
    model.generation_config.eos_token_id = 7
    assert add_turn_end(model, tok) == [7, system, end]
    assert model.generation_config.eos_token_id == [7, system, end]
    assert add_turn_end(model, tok) == [7, system, end]  # idempotent

    tok.chat_template = None
    assert chat_stop_ids(tok) == []

    loaded, gguf_tok = load_gguf(tiny_file[1], dtype=torch.float32)
    assert chat_stop_ids(gguf_tok) == [end]
    eos = loaded.generation_config.eos_token_id
    assert end in ([eos] if isinstance(eos, int) else eos)


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"real GGUF model not found at {REAL_GGUF} "
                    "(set QERL_REAL_MODEL to a qwen2.5 instruct .gguf)")
def test_real_qwen_gguf_tokenizer_stops_at_im_end():
    tok = AutoTokenizer.from_pretrained(str(REAL_GGUF.parent), gguf_file=REAL_GGUF.name)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(im_end, int) and im_end != tok.unk_token_id
    assert tok.convert_ids_to_tokens(im_end) == "<|im_end|>"
    assert chat_stop_ids(tok) == [im_end]
    assert im_end in special_ids(tok, None)[1]


def test_quantize_command_exports_a_gguf_with_its_tokenizer(tiny_file, tiny_tok, tmp_path, capsys):
    """`qerl quantize model.gguf --out DIR`: no source directory to copy from, so the loaded
    tokenizer and chat template are written into the export."""
    from qerl_kit.cli import main

    _, path = tiny_file
    out = tmp_path / "export"
    assert main(["quantize", str(path), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    exported = AutoTokenizer.from_pretrained(str(out))
    assert exported(SAMPLE)["input_ids"] == tiny_tok(SAMPLE)["input_ids"]
    assert exported.chat_template == tiny_tok.chat_template
    assert "wrote an NVFP4" in capsys.readouterr().out
