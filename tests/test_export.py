"""NVFP4 checkpoints in compressed-tensors' format: bit-exact with its decompressor, byte-stable
round trips, llm-compressor-style checkpoints loading in ours, sharding, peft, errors."""

import collections
import json
import string

import pytest
import torch
from safetensors import safe_open

from qerl_kit import ct_format
from qerl_kit.export import checkpoint_tensors, load_nvfp4, save_nvfp4
from qerl_kit.linear import NVFP4Linear, QuantLinear
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from tests.ct_reference import ct_dequantize, ct_quantize

ARCHS = ["qwen2-tiny", "qwen3-tiny", "llama-tiny"]
IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8]])


def _quantized(arch="qwen2-tiny", seed=0, **overrides):
    model = build_model(arch, dtype=torch.bfloat16, seed=seed, **overrides)
    quantize_model(model)
    return model


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<eos>", "<unk>"] + list(string.printable[:95])
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")


def _file_tensors(path):
    out = {}
    for file in sorted(set(ct_format.read_weight_map(path).values())):
        with safe_open(str(path / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _quant_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _same_files(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs"
    return names


# ---- the format ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_compressed_tensors_decompression_of_our_files_is_bit_exact(arch, tmp_path):
    model = _quantized(arch)
    save_nvfp4(model, tmp_path)
    files = _file_tensors(tmp_path)
    layers = _quant_layers(model)
    assert len(layers) == 14
    for name, layer in layers.items():
        packed, scale, gs = (files[f"{name}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert (packed.dtype, scale.dtype, gs.dtype) == (torch.uint8, torch.float8_e4m3fn, torch.float32)
        assert packed.shape == (layer.out_features, layer.in_features // 2)
        assert scale.shape == (layer.out_features, layer.in_features // 16) and gs.shape == (1,)
        assert f"{name}.weight" not in files
        assert torch.equal(ct_dequantize(packed, scale, gs), layer.dequantized_weight(torch.bfloat16)), name
    dense = {k: v for k, v in files.items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    assert "lm_head.weight" in dense and "model.embed_tokens.weight" in dense
    assert all(v.dtype == torch.bfloat16 for v in dense.values())
    has_bias = {k for k in files if k.endswith("_proj.bias")}
    assert bool(has_bias) == (arch == "qwen2-tiny")  # Qwen2 has q/k/v biases; Qwen3 and Llama none
    if arch == "qwen3-tiny":
        assert "model.layers.0.self_attn.q_norm.weight" in dense


def test_transformers_compressed_tensors_loader_reads_our_checkpoint(tmp_path):
    """compressed-tensors' ModelCompressor (through transformers) decompresses the whole checkpoint."""
    from transformers import AutoModelForCausalLM

    model = _quantized("qwen3-tiny")
    save_nvfp4(model, tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(_logits(theirs), _logits(model))


def test_quantization_config_is_what_vllm_matches(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    import compressed_tensors

    save_nvfp4(_quantized("llama-tiny"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "nvfp4-pack-quantized"
    assert q["quantization_status"] == "compressed" and q["ignore"] == ["lm_head"]
    assert q["version"] == compressed_tensors.__version__
    assert {k: q[k] for k in ("kv_cache_scheme", "global_compression_ratio", "sparsity_config",
                              "transform_config")} == {"kv_cache_scheme": None, "global_compression_ratio": None,
                                                       "sparsity_config": {}, "transform_config": {}}
    (group,) = q["config_groups"].values()
    w = group["weights"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert {k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")} == \
        {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True, "dynamic": False}
    assert w["scale_dtype"] == "torch.float8_e4m3fn"
    # compressed-tensors parses it, and vLLM's _is_fp4a16_nvfp4 conditions hold on the parsed args
    parsed = QuantizationConfig.model_validate({k: v for k, v in q.items() if k not in ("version",)})
    args = parsed.config_groups["group_0"].weights
    assert parsed.config_groups["group_0"].input_activations is None
    assert (args.num_bits, args.type, args.strategy, args.group_size, args.symmetric) == (4, "float", "tensor_group", 16, True)
    # what older transformers/vLLM read from the config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] and "qerl_quantization" not in cfg


def test_fused_groups_share_their_global_scale_in_the_file(tmp_path):
    save_nvfp4(_quantized("qwen2-tiny"), tmp_path)
    files = _file_tensors(tmp_path)
    gs = lambda n: files[f"model.layers.1.{n}.weight_global_scale"]  # noqa: E731
    assert torch.equal(gs("self_attn.q_proj"), gs("self_attn.k_proj")) and torch.equal(gs("self_attn.q_proj"), gs("self_attn.v_proj"))
    assert torch.equal(gs("mlp.gate_proj"), gs("mlp.up_proj"))
    assert not torch.equal(gs("self_attn.q_proj"), gs("self_attn.o_proj"))


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_save_is_byte_identical_and_logits_match(arch, tmp_path):
    model, tok = _quantized(arch), _tokenizer()
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    save_nvfp4(model, first, tokenizer=tok)
    loaded = load_nvfp4(first)
    assert torch.equal(_logits(loaded), _logits(model))
    save_nvfp4(loaded, second, source_dir=first)
    names = _same_files(first, second)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(names)
    save_nvfp4(loaded, third, tokenizer=tok)
    _same_files(first, third)


def test_load_never_materialises_a_dense_copy_of_a_quantized_weight(tmp_path):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    model = _quantized("qwen2-tiny")
    save_nvfp4(model, tmp_path)
    dense_shapes = {(m.out_features, m.in_features) for m in _quant_layers(model).values()}

    class Record(TorchDispatchMode):
        seen = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.seen[(t.dtype, tuple(t.shape))] += 1
            return out

    with Record() as rec:
        loaded = load_nvfp4(tmp_path)
    assert rec.seen, "the dispatch mode saw no tensors"
    made = [(dt, s) for dt, s in rec.seen if dt.is_floating_point and dt.itemsize > 1 and s in dense_shapes]
    assert made == [], f"dense copies of quantized weights were created: {made}"
    layers = _quant_layers(loaded)
    assert len(layers) == 14 and all(isinstance(m, NVFP4Linear) for m in layers.values())
    for m in layers.values():
        assert (m.packed.dtype, m.scales.dtype, m.global_scale.dtype) == (torch.uint8, torch.float8_e4m3fn, torch.float32)
    assert not any(tuple(p.shape) in dense_shapes for p in loaded.parameters())
    assert not any(t.is_meta for t in list(loaded.parameters()) + list(loaded.buffers()))


def test_sharding_writes_an_index_covering_every_tensor(tmp_path):
    model = _quantized("qwen3-tiny")
    expected, _ = checkpoint_tensors(model)
    save_nvfp4(model, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / ct_format.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for file in files:
        with safe_open(str(tmp_path / file), framework="pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == file}
    assert torch.equal(_logits(load_nvfp4(tmp_path)), _logits(model))
    save_nvfp4(model, tmp_path)  # re-saving unsharded removes the old shards and index
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert ct_format.parse_size("2GB") == 2 * 10**9 and ct_format.parse_size("1GiB") == 2**30


def test_tied_embeddings_are_saved_once_and_retied(tmp_path):
    model = _quantized("qwen2-tiny", tie_word_embeddings=True)
    save_nvfp4(model, tmp_path)
    assert "lm_head.weight" not in _file_tensors(tmp_path)
    loaded = load_nvfp4(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(_logits(loaded), _logits(model))


# ---- an llm-compressor-style checkpoint ---------------------------------------------------------
def _llm_compressor_checkpoint(arch, path):
    """What llm-compressor's NVFP4A16 oneshot writes: compressed-tensors applies the scheme, the
    scales come from compressed-tensors' own functions (fused groups sharing a global scale from
    their joint min/max), ModelCompressor compresses, transformers saves, update_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import generate_gparam

    model = build_model(arch, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])}, ignore=["lm_head"]))
    fused = {g: grp for grp in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")) for g in grp}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not hasattr(module, "weight_global_scale"):
                continue
            parent_name, child = name.rsplit(".", 1)
            parent = model.get_submodule(parent_name)
            ws = [getattr(parent, g).weight for g in fused.get(child, (child,))]
            gs = generate_gparam(torch.stack([w.amin() for w in ws]).amin(), torch.stack([w.amax() for w in ws]).amax())
            _, scale, gs = ct_quantize(module.weight, gs)
            module.weight_global_scale.copy_(gs)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, "nvfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_llm_compressor_style_checkpoint_loads_and_matches_our_quantization(arch, tmp_path):
    _llm_compressor_checkpoint(arch, tmp_path)
    assert "weight_packed" in str(_file_tensors(tmp_path).keys())
    loaded = load_nvfp4(tmp_path)
    ours = _quantized(arch)
    assert torch.equal(_logits(loaded), _logits(ours))
    for name, layer in _quant_layers(ours).items():
        other = loaded.get_submodule(name)
        assert torch.equal(other.packed, layer.packed) and torch.equal(other.global_scale, layer.global_scale)


# ---- peft ---------------------------------------------------------------------------------------
def test_peft_model_saves_its_base_and_the_adapter_reloads(tmp_path):
    from qerl_kit.aqn import AQN
    from qerl_kit.lora import attach_lora

    model = attach_lora(_quantized("qwen2-tiny"), r=4, train_norms=True, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    clean_norm = model.base_model.model.model.layers[0].input_layernorm.original_module.weight.detach().clone()
    expected = _logits(model)
    aqn = AQN(total_steps=10)
    with aqn.noise(model, step=9):  # noise on the trained norms never reaches a file
        save_nvfp4(model, tmp_path / "base", adapter_dir=tmp_path / "adapter")
    files = _file_tensors(tmp_path / "base")
    assert not any("lora_" in k or "base_layer" in k or "modules_to_save" in k or "original_module" in k for k in files)
    assert torch.equal(files["model.layers.0.input_layernorm.weight"], clean_norm)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = load_nvfp4(tmp_path / "base", adapter_dir=tmp_path / "adapter")
    assert torch.equal(_logits(reloaded), expected)


# ---- errors -------------------------------------------------------------------------------------
def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no NVFP4 layers"):
        save_nvfp4(build_model("qwen2-tiny", dtype=torch.bfloat16), tmp_path / "x")
    for fmt in ("mxfp4", "nf4"):
        m = build_model("llama-tiny", dtype=torch.bfloat16)
        quantize_model(m, fmt=fmt)
        with pytest.raises(ValueError, match=f"quantized to {fmt}, not NVFP4"):
            save_nvfp4(m, tmp_path / fmt)
    m = _quantized("qwen2-tiny")
    k_proj = m.model.layers[0].self_attn.k_proj
    k_proj.global_scale = k_proj.global_scale * 2  # q/k/v share one tensor: give k its own
    with pytest.raises(ValueError, match="different global scales"):
        save_nvfp4(m, tmp_path / "y")
    m = build_model("qwen2-tiny", dtype=torch.bfloat16)
    quantize_model(m, skip=("lm_head", "k_proj"))
    with pytest.raises(ValueError, match="mixes NVFP4 and dense"):
        save_nvfp4(m, tmp_path / "z")
    m = build_model("qwen2-tiny", dtype=torch.bfloat16)
    quantize_model(m, skip=())
    with pytest.raises(ValueError, match="lm_head"):
        save_nvfp4(m, tmp_path / "v")
    with pytest.raises(ValueError, match="adapter_dir"):
        save_nvfp4(_quantized(), tmp_path / "w", adapter_dir=tmp_path / "a")
    # loading: a dense checkpoint, and a non-NVFP4 quantization config
    dense = build_model("qwen2-tiny", dtype=torch.bfloat16)
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="no quantization_config"):
        load_nvfp4(tmp_path / "dense")
    save_nvfp4(_quantized(), tmp_path / "q")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not NVFP4"):
        load_nvfp4(tmp_path / "q")


def test_cli_quantize_out_writes_a_checkpoint(tmp_path, capsys):
    from qerl_kit.cli import main

    assert main(["quantize", "llama-tiny", "--out", str(tmp_path / "ck"), "--shard-size", "50KB"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    assert (tmp_path / "ck" / ct_format.INDEX_FILE).is_file()
    assert len(_quant_layers(load_nvfp4(tmp_path / "ck"))) == 14
    assert main(["quantize", "llama-tiny", "--format", "nf4", "--out", str(tmp_path / "nf4")]) == 2
    assert "cannot be exported" in capsys.readouterr().err


# ---- never destroy a user's files ---------------------------------------------------------------
def _snapshot(path):
    """Every file under ``path`` (relative name -> bytes), to prove nothing was touched."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _tiny_source(tmp_path):
    """A private copy of the shipped tiny model (qerl_kit/assets/tiny-arith) and the model loaded
    from it, quantized to NVFP4."""
    import shutil

    from qerl_kit.tiny import TINY_DIR, load_tiny

    src = tmp_path / "tiny-arith"
    shutil.copytree(TINY_DIR, src)
    model, _ = load_tiny(src, quantize="nvfp4", dtype=torch.bfloat16)
    return src, model


def _refused():
    from qerl_kit.export import RefusedToOverwrite

    return RefusedToOverwrite


def test_export_into_the_source_dir_is_refused_and_the_source_is_intact(tmp_path):
    src, model = _tiny_source(tmp_path)
    before = _snapshot(src)
    with pytest.raises(_refused(), match="source") as err:
        save_nvfp4(model, src, source_dir=src)
    assert str(src) in str(err.value)
    link = tmp_path / "link-to-source"
    link.symlink_to(src, target_is_directory=True)
    with pytest.raises(_refused(), match="source"):  # the same directory through a symlink
        save_nvfp4(model, link, source_dir=src)
    with pytest.raises(_refused(), match="source"):  # inside the source directory
        save_nvfp4(model, src / "nvfp4", source_dir=src)
    with pytest.raises(_refused(), match="source"):  # the source inside the output
        save_nvfp4(model, tmp_path, source_dir=src)
    assert _snapshot(src) == before and sorted(p.name for p in src.iterdir()) == sorted(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link-to-source", "tiny-arith"]  # no temp dirs left
    save_nvfp4(model, tmp_path / "ok", source_dir=src)  # a separate directory is fine
    assert (tmp_path / "ok" / "tokenizer.json").read_bytes() == before["tokenizer.json"]
    assert _snapshot(src) == before


def test_cli_quantize_out_equal_to_the_model_dir_fails_and_keeps_the_model(tmp_path):
    from qerl_kit.cli import main

    src, _ = _tiny_source(tmp_path)
    before = _snapshot(src)
    try:
        rc = main(["quantize", str(src), "--out", str(src)])
    except _refused():
        rc = "raised"  # until qerl_kit.cli catches RefusedToOverwrite (then: exit code 2)
    assert rc != 0
    assert _snapshot(src) == before


def test_a_non_empty_foreign_dir_is_refused_and_its_files_are_intact(tmp_path):
    model = _quantized("qwen2-tiny")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "model.safetensors").write_bytes(b"not yours")
    (out / "config.json").write_text("{}")
    before = _snapshot(out)
    with pytest.raises(_refused()) as err:
        save_nvfp4(model, out)
    msg = str(err.value)
    assert str(out) in msg and "config.json" in msg and "notes.txt" in msg
    assert _snapshot(out) == before
    # a file where the directory should be
    (tmp_path / "file").write_text("x")
    with pytest.raises(_refused()):
        save_nvfp4(model, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    # an earlier export of ours, plus a file it did not write: replacing it would delete that file
    save_nvfp4(model, tmp_path / "ours")
    (tmp_path / "ours" / "README.md").write_text("my card")
    before = _snapshot(tmp_path / "ours")
    with pytest.raises(_refused(), match="README.md"):
        save_nvfp4(model, tmp_path / "ours")
    assert _snapshot(tmp_path / "ours") == before
    # an empty directory is written into
    (tmp_path / "empty").mkdir()
    save_nvfp4(model, tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file", "mine", "ours"]  # no temp dirs left


def test_a_foreign_adapter_dir_is_refused(tmp_path):
    from qerl_kit.lora import attach_lora

    model = attach_lora(_quantized("qwen2-tiny"), r=4, seed=0)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{\"mine\": true}")
    with pytest.raises(_refused(), match="adapter_config.json"):
        save_nvfp4(model, tmp_path / "base", adapter_dir=adapter)
    assert (adapter / "adapter_config.json").read_text() == "{\"mine\": true}"
    assert not (tmp_path / "base").exists()  # nothing written when any target is refused
    with pytest.raises(_refused()):
        save_nvfp4(model, tmp_path / "base", adapter_dir=tmp_path / "base")
    save_nvfp4(model, tmp_path / "base", adapter_dir=tmp_path / "lora")
    save_nvfp4(model, tmp_path / "base", adapter_dir=tmp_path / "lora")  # both replaced: ours
    marker = json.loads((tmp_path / "lora" / ".qerl_export.json").read_text())
    assert "adapter_model.safetensors" in marker["files"]


def test_re_export_replaces_an_earlier_export_and_removes_only_its_stale_shards(tmp_path):
    model = _quantized("qwen3-tiny")
    out = tmp_path / "ck"
    save_nvfp4(model, out, tokenizer=_tokenizer(), max_shard_size="20KB")
    marker = json.loads((out / ".qerl_export.json").read_text())
    assert marker["version"] == 1
    on_disk = sorted(p.name for p in out.iterdir() if p.name != ".qerl_export.json")
    assert marker["files"] == on_disk and ct_format.INDEX_FILE in on_disk and "tokenizer.json" in on_disk
    shards = [n for n in on_disk if n.startswith("model-")]
    assert len(shards) > 3
    save_nvfp4(model, out)  # unsharded, no tokenizer: every file of the first export goes
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / ".qerl_export.json").read_text())["files"] == \
        sorted(p.name for p in out.iterdir() if p.name != ".qerl_export.json")
    assert torch.equal(_logits(load_nvfp4(out)), _logits(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or backup dirs left


def test_a_crash_mid_write_leaves_the_earlier_export_intact_and_loadable(tmp_path, monkeypatch):
    import safetensors.torch

    first = _quantized("qwen2-tiny", seed=0)
    out = tmp_path / "ck"
    save_nvfp4(first, out, max_shard_size="20KB")
    before = _snapshot(out)
    real, calls = safetensors.torch.save_file, []

    def failing(*args, **kwargs):  # the shard writer: the first shards are written, then it fails
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save_nvfp4(_quantized("qwen2-tiny", seed=1), out, max_shard_size="20KB")
    assert len(calls) == 3
    monkeypatch.undo()
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the partial new export is cleaned up
    assert torch.equal(_logits(load_nvfp4(out)), _logits(first))
