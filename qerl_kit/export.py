"""Save a quantized model as a vLLM-loadable NVFP4 checkpoint, and load such checkpoints back.

``save_nvfp4(model, "out/")`` writes a compressed-tensors ``nvfp4-pack-quantized`` weight-only
(NVFP4A16) checkpoint (format details in ``qerl_kit.ct_format``): the packed codes, fp8 block
scales and fp32 global scale of every ``NVFP4Linear`` exactly as they are in memory (no
requantization, so vLLM serves bit-for-bit the weights we trained against), the dense tensors
(embeddings, norms, ``lm_head``, biases) in ``dtype`` (bf16), ``config.json`` with the
``quantization_config`` vLLM's ``CompressedTensorsW4A16Fp4`` matches, the tokenizer and the
generation config. A peft model is accepted: its base is saved (LoRA matrices, ``base_layer`` and
``modules_to_save`` copies stripped) and ``adapter_dir=`` also saves the adapter with peft.

``load_nvfp4("out/")`` reads such a checkpoint, ours or llm-compressor's, straight into
``NVFP4Linear`` layers: the model skeleton is built on the meta device from ``config.json``, each
Linear named in the checkpoint is replaced by an ``NVFP4Linear`` holding the stored tensors, and
the dense tensors are assigned one by one. No dense copy of a quantized weight is ever made.

Files are deterministic: saving, loading and saving again gives byte-identical files.

``save_nvfp4`` never deletes or overwrites a file it did not write. It refuses
(``RefusedToOverwrite``) to write into, or around, the ``source_dir`` model; into a non-empty
directory that is not an earlier export of ours (recognised by the ``.qerl_export.json`` marker it
writes, listing its files); and over an earlier export that has gained files of someone else's.
Every export is first written into a temporary sibling directory and then renamed into place, so
a crash mid-write leaves the earlier export (or no directory) as it was.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch
from torch import nn

from qerl_kit import ct_format, file_writes
from qerl_kit.linear import NVFP4Linear, QuantLinear
from qerl_kit.nvfp4 import NVFP4Tensor
from qerl_kit.quantize import FUSED_GROUPS
from qerl_kit.export_dirs import (_ADAPTER, _CHECKPOINT, EXPORT_MARKER, RefusedToOverwrite,  # noqa: F401
                                  _real, _staging_dir, _swap_in, _write_marker, check_export_dirs, clean_leftovers,
                                  discard_staging)

__all__ = ["save_nvfp4", "load_nvfp4", "checkpoint_tensors", "check_export_dirs", "RefusedToOverwrite",
           "EXPORT_MARKER", "TOKENIZER_FILES", "DENSE_DTYPES", "check_dense_dtype"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
_DROP_CONFIG_KEYS = ("_name_or_path", "qerl_quantization", "quantization_config")
# The dtypes the dense tensors (embeddings, norms, lm_head, biases) may be written or loaded in.
DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_dense_dtype(dtype, allow_none: bool = True):
    """``dtype`` for the dense tensors: a floating dtype of ``DENSE_DTYPES`` (or None, keep theirs,
    where ``allow_none``); an int8 embedding would be all zeros, so anything else is refused."""
    if (dtype is None and allow_none) or dtype in DENSE_DTYPES:
        return dtype
    from qerl_kit.config_types import short_repr

    allowed = ", ".join(str(d) for d in DENSE_DTYPES) + (" or None (keep each tensor's)" if allow_none else "")
    raise ValueError(f"dtype must be a floating dtype for the dense tensors: {allowed}; got {short_repr(dtype)}")


def _base_model(model: nn.Module) -> nn.Module:
    """The model under a peft wrapper (the wrapper's LoRA layers are filtered by name later)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _clean_name(name: str) -> str | None:
    """A module name without peft's wrappers; None for LoRA parts and modules_to_save copies."""
    parts = name.split(".") if name else []
    if any(p.startswith("lora_") or p == "modules_to_save" for p in parts):
        return None
    return ".".join(p for p in parts if p not in ("base_layer", "original_module"))


def _scan(base: nn.Module) -> tuple[dict[str, QuantLinear], list[str]]:
    """(quantized layers by clean name, clean names of the dense nn.Linear layers)."""
    quant: dict[str, QuantLinear] = {}
    dense: list[str] = []
    for name, module in base.named_modules():
        clean = _clean_name(name)
        if clean is None:
            continue
        if isinstance(module, QuantLinear):
            if not isinstance(module, NVFP4Linear):
                raise ValueError(f"layer {clean!r} is quantized to {module.fmt}, not NVFP4: only NVFP4 "
                                 "exports to compressed-tensors/vLLM (quantize_model(model, 'nvfp4'))")
            quant[clean] = module
        elif isinstance(module, nn.Linear):
            dense.append(clean)
    if not quant:
        raise ValueError("the model has no NVFP4 layers to export; quantize it first with "
                         "qerl_kit.quantize.quantize_model(model, 'nvfp4')")
    return quant, dense


def _check_fused(quant: dict[str, QuantLinear], dense: list[str]) -> None:
    """vLLM fuses q/k/v and gate/up: members must all be quantized and share one global scale."""
    dense_set = set(dense)
    for group in FUSED_GROUPS:
        parents = {n.rsplit(".", 1)[0] for n in quant if n.rsplit(".", 1)[-1] in group}
        for parent in sorted(parents):
            names = [f"{parent}.{g}" for g in group]
            if any(n in dense_set for n in names):
                raise ValueError(f"fused group {names} mixes NVFP4 and dense layers; vLLM fuses them "
                                 "into one layer, so quantize all of them or none")
            members = [quant[n] for n in names if n in quant]
            if len(members) < 2:
                continue
            scales = [m.global_scale.detach().float().cpu().reshape(-1) for m in members]
            if any(not torch.equal(scales[0], s) for s in scales[1:]):
                raise ValueError(
                    f"fused group {names} has different global scales {[s.tolist() for s in scales]}; vLLM "
                    "keeps one per fused layer, so the others would dequantize wrong. Quantize with "
                    "quantize_model(..., share_fused_scales=True) (the default)")


def checkpoint_tensors(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16):
    """(name -> tensor in checkpoint naming, ignore list): what ``save_nvfp4`` writes, in module order.

    Quantized layers give ``weight_packed``/``weight_scale``/``weight_global_scale`` (+ ``bias``);
    every other tensor keeps its name, floating ones cast to ``dtype`` (None keeps them). Tied
    output embeddings are left out (``config.tie_word_embeddings`` re-ties them at load).
    """
    check_dense_dtype(dtype)
    base = _base_model(model)
    quant, dense = _scan(base)
    _check_fused(quant, dense)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if isinstance(head, QuantLinear):
        raise ValueError("the output head (lm_head) is quantized; vLLM keeps it dense, so quantize with "
                         "skip=('lm_head',) (the default)")
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    head_key = next((f"{_clean_name(n)}.weight" for n, m in base.named_modules() if m is head), None)
    for key, tensor in base.state_dict().items():
        module_name, _, attr = key.rpartition(".")
        clean = _clean_name(module_name)
        if clean is None:
            continue
        ptr = tensor.data_ptr() if tensor.numel() and tensor.device.type != "meta" else None
        if clean in quant:
            name = f"{clean}.{ct_format.BUFFER_TO_CT[attr]}" if clean else ct_format.BUFFER_TO_CT[attr]
            if attr == "bias" and dtype is not None:
                tensor = tensor.to(dtype)
        else:
            name = f"{clean}.{attr}" if clean else attr
            if tensor.is_floating_point() and dtype is not None:
                tensor = tensor.to(dtype)
        if tensor.device.type == "meta":
            raise ValueError(f"tensor {name!r} is on the meta device (not loaded); cannot export it")
        if ptr is not None and ptr in seen:
            if tied and name == head_key:
                continue  # the tied lm_head: vLLM and load_nvfp4 re-tie it from the config
            tensor = tensor.clone()  # e.g. a fused group's one global-scale tensor
        if ptr is not None:
            seen.setdefault(ptr, name)
        tensors[name] = tensor
    ignore = [n for n in dense if n]
    return tensors, ignore


def _export_config(base: nn.Module, ignore: list[str], dtype: torch.dtype | None) -> dict:
    cfg = base.config.to_dict()
    for key in _DROP_CONFIG_KEYS:
        cfg.pop(key, None)
    cfg["architectures"] = cfg.get("architectures") or [type(base).__name__]
    if dtype is not None:
        cfg["dtype"] = str(dtype).removeprefix("torch.")
    if cfg.get("dtype"):
        cfg["torch_dtype"] = cfg["dtype"]  # the key transformers < 4.56 (and older vLLM) read
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # transformers 5 moved these; 4.x reads them
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    cfg["quantization_config"] = ct_format.nvfp4a16_quantization_config(ignore)
    return cfg


def _save_side_files(base, path: Path, tokenizer, source_dir) -> None:
    copied_gen = False
    if source_dir is not None:
        src = Path(source_dir)
        for name in TOKENIZER_FILES + ("generation_config.json",):
            if (src / name).is_file():
                shutil.copyfile(src / name, path / name)
        copied_gen = (src / "generation_config.json").is_file()
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    gen = getattr(base, "generation_config", None)
    if not copied_gen and gen is not None:
        (path / "generation_config.json").write_text(gen.to_json_string(use_diff=True), encoding="utf-8")


def _write_checkpoint(ckpt: Path, base: nn.Module, tensors: dict, ignore, dtype, max_shard_size,
                      tokenizer, source_dir) -> None:
    """Fill the staging directory ``ckpt`` with the whole export: weights, config.json, tokenizer and
    generation files, and our marker."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    # copy=True: a buffer may be a view into a bigger one (StaticEngine fuses q/k/v and gate/up
    # in place), which safetensors would refuse as shared memory
    producers = {name: (lambda t=t: t.detach().to("cpu", copy=True).contiguous()) for name, t in tensors.items()}
    ct_format.write_safetensors(ckpt, producers, sizes, max_shard_size)
    ct_format.write_json(ckpt / "config.json", _export_config(base, ignore, dtype))
    _save_side_files(base, ckpt, tokenizer, source_dir)
    _write_marker(ckpt, _CHECKPOINT)


def _write_adapter(adapter: Path, model) -> None:
    """Fill the staging directory ``adapter`` with a peft model's adapter and our marker."""
    model.save_pretrained(str(adapter))
    file_writes.match_umask(adapter)  # safetensors writes 0600
    _write_marker(adapter, _ADAPTER)


def save_nvfp4(model: nn.Module, path: str | Path, *, tokenizer=None, max_shard_size: int | str = "2GB",
               source_dir: str | Path | None = None, adapter_dir: str | Path | None = None,
               dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write ``model`` (NVFP4-quantized, plain or peft-wrapped) as a compressed-tensors checkpoint.

    ``tokenizer``: saved with ``save_pretrained``; ``source_dir``: the original model directory,
    whose tokenizer files and generation_config.json are copied. ``max_shard_size``: bytes or a
    string like "2GB"; above it the weights are sharded with ``model.safetensors.index.json``.
    ``adapter_dir``: also save a peft model's adapter there (``save_pretrained``). ``dtype``: the
    dtype of the dense tensors (None keeps theirs). Returns the checkpoint directory.

    ``path`` (and ``adapter_dir``) must be new, empty, or an earlier export of ours holding only
    the files its ``.qerl_export.json`` lists, which is then replaced as a whole; it must not be,
    contain or lie inside ``source_dir``. Anything else raises ``RefusedToOverwrite`` before a
    byte is written. The new files are written into a temporary sibling directory and renamed
    into place, so an error or crash while writing leaves the earlier export as it was.
    """
    check_dense_dtype(dtype)
    ct_format.parse_size(max_shard_size)  # a bad size refused before anything is written
    base = _base_model(model)
    if adapter_dir is not None and base is model:
        raise ValueError("adapter_dir was given but the model has no peft adapter to save")
    tensors, ignore = checkpoint_tensors(model, dtype)
    targets = [(_real(path), _CHECKPOINT, "the export directory")]
    if adapter_dir is not None:
        targets.append((_real(adapter_dir), _ADAPTER, "adapter_dir"))
    for target, kind, _ in targets:  # what a crashed export left: put back or removed
        clean_leftovers(target, kind)
    check_export_dirs(path, source_dir=source_dir, adapter_dir=adapter_dir)
    pending: list[tuple[Path, tuple]] = []  # (staging directory, its target), not yet in place
    try:
        ckpt = _staging_dir(targets[0][0])
        pending.append((ckpt, targets[0]))
        _write_checkpoint(ckpt, base, tensors, ignore, dtype, max_shard_size, tokenizer, source_dir)
        if adapter_dir is not None:
            adapter = _staging_dir(targets[1][0])
            pending.append((adapter, targets[1]))
            _write_adapter(adapter, model)
        while pending:  # both written in full: now the renames
            staged, target = pending[0]
            _swap_in(staged, *target)
            pending.pop(0)
    except Exception as err:  # noqa: BLE001 - a full disk shows as several error types
        full = file_writes.disk_full(err, pending[-1][1][0] if pending else targets[0][0])
        if full is None:
            raise
        raise file_writes.DiskFullError(f"{full}; nothing was exported to {path} (an earlier export there is "
                                        "intact)") from err
    finally:
        for staged, _ in pending:  # only our own staging directories, never put in place
            discard_staging(staged)
    return Path(path)


# ---- loading ------------------------------------------------------------------------------------
def _skeleton(path: Path, dtype: torch.dtype) -> nn.Module:
    """The model built from config.json on the meta device (no memory), remote code off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qerl_kit.model_files import ModelSourceError

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # we load the packed tensors ourselves
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except (ValueError, TypeError, KeyError, RuntimeError) as err:  # a value no model can have, named with the file
        raise ModelSourceError(f"{path / 'config.json'} describes no model transformers can build "
                               f"({type(err).__name__}: {str(err)[:200]})") from err


def _set_tensor(model: nn.Module, key: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ValueError(f"checkpoint tensor {key!r} has no module {module_name!r} in "
                         f"{type(model).__name__}") from None
    old = module._parameters.get(attr) if attr in module._parameters else module._buffers.get(attr)
    if attr not in module._parameters and attr not in module._buffers:
        raise ValueError(f"checkpoint tensor {key!r}: {type(module).__name__} has no parameter {attr!r}")
    if old is not None and tuple(old.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}; the model "
                         f"expects {tuple(old.shape)} (config.json does not match the weights)")
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
    else:
        module._buffers[attr] = tensor


def _quant_layer(module: nn.Module, name: str, get, keys: set[str], dtype: torch.dtype) -> NVFP4Linear:
    if type(module) is not nn.Linear:
        raise ValueError(f"checkpoint quantizes {name!r}, but in the model it is a "
                         f"{type(module).__name__}, not an nn.Linear")
    for suffix in (ct_format.SCALE, ct_format.GLOBAL_SCALE):
        if f"{name}.{suffix}" not in keys:
            raise ValueError(f"checkpoint has {name}.{ct_format.PACKED} but no {name}.{suffix}")
    if f"{name}.weight_zero_point" in keys:
        raise ValueError(f"{name} has a weight_zero_point (asymmetric); NVFP4 is symmetric only")
    packed, scales = get(f"{name}.{ct_format.PACKED}"), get(f"{name}.{ct_format.SCALE}")
    gscale = get(f"{name}.{ct_format.GLOBAL_SCALE}").to(torch.float32).reshape(1)
    out_f, in_f = module.out_features, module.in_features
    expect = {"packed": ((out_f, in_f // 2), torch.uint8, packed),
              "scale": ((out_f, in_f // 16), torch.float8_e4m3fn, scales)}
    for what, (shape, dt, t) in expect.items():
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ValueError(f"{name}: {what} is {t.dtype} {tuple(t.shape)}, expected {dt} {shape} "
                             f"for a Linear({in_f}, {out_f})")
    bias = get(f"{name}.bias").to(dtype) if f"{name}.bias" in keys else None
    if (bias is None) != (module.bias is None):
        raise ValueError(f"{name}: the model {'has' if module.bias is not None else 'has no'} bias but "
                         f"the checkpoint {'has none' if bias is None else 'has one'}")
    return NVFP4Linear(in_f, out_f, bias, NVFP4Tensor(packed, scales, gscale), compute_dtype=dtype)


def _materialize_buffers(model: nn.Module, device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints: recompute them off meta."""
    owners = {}
    for key, buf in list(model.named_buffers()):
        if buf is not None and buf.is_meta:
            module_name, _, attr = key.rpartition(".")
            module = model.get_submodule(module_name)
            module._buffers[attr] = torch.empty_like(buf, device=device)
            owners[id(module)] = module
    with torch.no_grad():
        for module in owners.values():
            model._init_weights(module)


def _load_tensors(model: nn.Module, weight_map: dict[str, str], get, dtype: torch.dtype) -> None:
    """Swap the checkpoint's quantized Linears for NVFP4Linear, then assign every dense tensor."""
    keys = set(weight_map)
    quantized = sorted(k[:-len(ct_format.PACKED) - 1] for k in keys if k.endswith("." + ct_format.PACKED))
    if not quantized:
        raise ValueError(f"the checkpoint has no '*.{ct_format.PACKED}' tensors: not an NVFP4 checkpoint")
    done = set()
    for name in quantized:
        module_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"checkpoint quantizes {name!r}, which the model does not have") from None
        setattr(parent, child, _quant_layer(getattr(parent, child, None), name, get, keys, dtype))
        done.update(f"{name}.{s}" for s in (ct_format.PACKED, ct_format.SCALE, ct_format.GLOBAL_SCALE,
                                            "bias", "input_global_scale"))
    for key in [k for k in weight_map if k not in done]:
        tensor = get(key)
        _set_tensor(model, key, tensor.to(dtype) if tensor.is_floating_point() else tensor)


def load_nvfp4(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               adapter_dir: str | Path | None = None, is_trainable: bool = False) -> nn.Module:
    """Load a compressed-tensors NVFP4 checkpoint (ours or llm-compressor's) into NVFP4Linear layers.

    Dense tensors are cast to ``dtype`` and everything lands on ``device``. With ``adapter_dir``
    the peft adapter saved there is attached (``qerl_kit.lora.load_lora``) and the peft model is
    returned. A W4A4 (``NVFP4``) checkpoint loads too; its activation scales are ignored (our
    layers compute in ``dtype``), with a warning.
    """
    from safetensors import safe_open

    from qerl_kit.finite import check_tensor
    from qerl_kit.model_files import check_weight_files, read_model_config

    dtype = check_dense_dtype(dtype, allow_none=False)
    path = Path(path)
    raw = read_model_config(path)  # bad JSON, a size no model can have: named with the file and key
    ignore, act_quant = ct_format.check_quantization_config(raw.get("quantization_config"))
    if act_quant:
        warnings.warn("this NVFP4 checkpoint also quantizes activations (W4A4); load_nvfp4 loads the "
                      "4-bit weights and computes activations in " + str(dtype), stacklevel=2)
    model = _skeleton(path, dtype)
    check_weight_files(path)  # a truncated file named, before its header is read
    weight_map = ct_format.read_weight_map(path)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(path / f), framework="pt", device=str(device)))
                   for f in sorted(set(weight_map.values()))}

        def get(key):  # every tensor checked as it is read: a NaN is named with its file, not found as NaN logits
            return check_tensor(key, handles[weight_map[key]].get_tensor(key), path / weight_map[key])

        _load_tensors(model, weight_map, get, dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    _materialize_buffers(model, device)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ValueError(f"{path} lacks tensors the model needs: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    model.config.qerl_quantization = {"format": "nvfp4", "skip": ignore}
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.eval()
    return model if adapter_dir is None else _load_adapter(model, Path(adapter_dir), is_trainable)


def _load_adapter(model: nn.Module, adapter_dir: Path, is_trainable: bool) -> nn.Module:
    """``qerl_kit.lora.load_lora``, with the LoRA matrices kept in the dtype they were saved in
    (peft upcasts bf16 adapters to fp32 by default, which shifts logits from the trained model's)."""
    from safetensors import safe_open

    from qerl_kit.lora import load_lora

    peft_model = load_lora(model, str(adapter_dir), is_trainable=is_trainable)
    weights = adapter_dir / "adapter_model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys() if "lora_" in k}
        names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
        if len(dtypes) == 1 and next(iter(dtypes)) in names:
            saved = names[next(iter(dtypes))]
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(saved)
    return peft_model
