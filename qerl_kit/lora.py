"""LoRA adapters on a frozen 4-bit base, through peft's custom-module dispatch.

``attach_lora(model, r=32)`` wraps every targeted ``QuantLinear`` (``NVFP4Linear`` and friends)
in ``QuantLoraLinear``, peft's own LoRA ``Linear`` with three changes: it reads in/out features
from the quantized layer, it refuses to merge (adding a bf16 delta into packed 4-bit codes
would need a requantization and lose the delta), and its forward adds the adapter's product inside
the GEMM (``lora_layer.FusedLoraLinear``, which wraps a bf16 model's ``torch.nn.Linear`` layers too,
so a bf16 baseline trains through the same LoRA arithmetic). So ``get_peft_model``, ``save_pretrained`` and
``PeftModel.from_pretrained`` work as usual and the adapter files are standard peft adapters:
the same file loads onto a bf16 copy of the model with plain peft, and vLLM serves it.

Only the LoRA matrices train (and, with ``train_norms=True``, the RMSNorm scales in front of the
projections, as the official QeRL code does through peft's ``modules_to_save``). The reference
policy for a KL term needs no second model: ``with model.disable_adapter(): ...``.

peft does not store custom-module mappings in ``adapter_config.json``; to reload an adapter onto
a quantized model use ``load_lora(model, path)``. It reads the files through the checked loader
that resume uses (``qerl_kit.adapter_files.load_adapter_weights``), not ``PeftModel.from_pretrained``
(which falls back to the Hub for a missing file and silently leaves missing tensors at their
initial values): a missing directory or file, a truncated file, missing, extra or misshaped
tensors, integer or NaN/inf tensors are a ``CheckpointError`` naming the path (and the tensor).
``adapter_config.json`` is checked too (``check_adapter_config``): r, lora_alpha and lora_dropout by
the rules ``attach_lora`` applies to its arguments (``check_lora_args``: ``config_types.LORA_R_RULE``
and ``LORA_ALPHA_RULE``, the config's ``model.lora_r`` and ``model.lora_alpha`` rules, dropout in
[0, 1)), and a peft feature the quantized layers lack (DoRA, LoRA biases, ...) is refused naming the
key, before any model is wrapped. This module takes plain arguments: it reads nothing of the config
or the checkpoint layers above it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer

from qerl_kit.adapter_files import CheckpointError, load_adapter_weights, read_adapter
from qerl_kit.config_types import (LORA_ALPHA_RULE, LORA_R_RULE, ConfigError, _Rule, check_lora_alpha, check_names,
                                   check_rule, check_seed, short_repr)
from qerl_kit.formats import FORMATS
from qerl_kit.linear import QuantLinear
from qerl_kit.lora_layer import FusedLoraLinear, PlainLinear

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS_BEFORE_PROJECTIONS = ("input_layernorm", "post_attention_layernorm")


class QuantLoraLinear(FusedLoraLinear):
    """peft's LoRA Linear over a frozen quantized base: y = base(x) + B(A(dropout(x))) * scale (the add
    in the GEMM: ``lora_layer.FusedLoraLinear``)."""

    def _get_in_out_features(self, module):
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        return base.in_features, base.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(
            "a LoRA adapter cannot be merged into a 4-bit base without requantizing it; keep it "
            "unmerged (the rollout engines apply it unmerged) or load the adapter onto a bf16 model "
            "and merge there")


def register_quant_layers(config: LoraConfig) -> LoraConfig:
    """Teach a peft LoraConfig to wrap qerl_kit's quantized layers, the layer class of every format of
    ``formats.FORMATS``, and plain ``torch.nn.Linear`` layers (a bf16 model) in ``FusedLoraLinear``
    (returns the same config)."""
    config._register_custom_module({**{fmt.linear: QuantLoraLinear for fmt in FORMATS.values()},
                                    PlainLinear: FusedLoraLinear})
    return config


# LoRA dropout: a share of the adapter's inputs zeroed in training; 1 would zero them all.
DROPOUT_RULE = _Rule(ge=0, lt=1, why="the share of the adapter's inputs dropped in training; 1 drops them all")


def check_lora_args(r, alpha, dropout, names=("r", "alpha", "dropout")) -> tuple[int, float | None, float]:
    """``r`` an int >= 1 (not a bool), ``alpha`` None (= r) or a finite float in (0, 1000 x r] (the
    config's ``model.lora_r`` / ``model.lora_alpha`` rules), ``dropout`` in [0, 1); a ``ConfigError`` naming
    the argument (``names``) otherwise. Returns them coerced."""
    r = check_rule(names[0], r, int, LORA_R_RULE)
    alpha = check_lora_alpha(names[1], alpha, r, r_key=names[0])  # the config's model.lora_alpha rule
    return r, alpha, check_rule(names[2], dropout, float, DROPOUT_RULE)


def lora_config(r: int = 32, alpha: float | None = None, targets: Sequence[str] = ALL_PROJECTIONS,
                dropout: float = 0.0, train_norms: bool = False) -> LoraConfig:
    """A peft LoraConfig for a quantized causal LM (alpha defaults to r, i.e. a scale of 1)."""
    r, alpha, dropout = check_lora_args(r, alpha, dropout)
    return register_quant_layers(LoraConfig(
        r=r, lora_alpha=r if alpha is None else alpha, target_modules=list(targets),
        lora_dropout=dropout, bias="none", task_type="CAUSAL_LM",
        modules_to_save=list(NORMS_BEFORE_PROJECTIONS) if train_norms else None))


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    for module in model.modules():
        if isinstance(module, QuantLinear):
            return module.compute_dtype
    return next(model.parameters()).dtype


def check_targets(model: torch.nn.Module, targets) -> tuple[str, ...]:
    """``targets`` as peft matches them (a module's name, or the end of its dotted name), each one
    naming at least one linear layer of ``model``: peft wraps what matches and silently ignores a
    target that matches nothing (a typo such as ``q_prj`` trains fewer layers than asked)."""
    names = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
    return check_names("targets", targets, names, lambda t, full: full == t or full.endswith("." + t),
                       what="linear layer", shown={n.rsplit(".", 1)[-1] for n in names}, empty=False)


def attach_lora(model: torch.nn.Module, r: int = 32, alpha: float | None = None,
                targets: Sequence[str] | None = None, dropout: float = 0.0,
                train_norms: bool = False, dtype: torch.dtype | None = None,
                seed: int | None = None) -> PeftModel:
    """Wrap ``model`` (quantized or not) in a peft LoRA model; only adapters (and norms) train.

    ``targets``: the layers to adapt (default ``ALL_PROJECTIONS``, those the model has); names given
    must each match a linear layer (``check_targets``). ``dtype`` is the adapters' dtype (default: the
    base's compute dtype, bf16 for a bf16 model), a floating dtype. ``seed`` makes the A-matrix
    initialisation reproducible. ``r``, ``alpha`` and ``dropout`` obey the config's rules (``check_lora_args``).
    """
    r, alpha, dropout = check_lora_args(r, alpha, dropout)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating torch dtype (torch.bfloat16, torch.float16, torch.float32) or "
                          f"None (the base's compute dtype); got {short_repr(dtype)}", "dtype", dtype, "a float dtype")
    targets = ALL_PROJECTIONS if targets is None else check_targets(model, targets)
    if seed is not None:
        torch.manual_seed(check_seed("seed", seed))
    peft_model = get_peft_model(model, lora_config(r, alpha, targets, dropout, train_norms))
    dtype = dtype or _compute_dtype(model)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
    return peft_model


def lora_config_for(path: str) -> LoraConfig:
    """The saved adapter's LoraConfig, with qerl_kit's quantized layers registered; a missing or
    unreadable ``adapter_config.json`` is a ``CheckpointError`` naming it (never a Hub download)."""
    root = Path(path)
    config = root / "adapter_config.json"
    if not root.is_dir():
        raise CheckpointError(f"adapter {path} is not a directory (a peft adapter directory holds "
                              "adapter_config.json and adapter_model.safetensors)")
    if not config.is_file():
        raise CheckpointError(f"{config} is missing: {path} is not a peft adapter directory")
    try:
        loaded = LoraConfig.from_pretrained(str(root))
    except Exception as err:  # noqa: BLE001 - bad JSON, unknown keys: peft raises several types
        raise CheckpointError(f"{config} cannot be read as a LoRA config ({type(err).__name__}: "
                              f"{str(err)[:200]})") from err
    try:
        check_adapter_config(loaded)
    except ConfigError as err:
        raise CheckpointError(f"{config}: {err}") from None
    return register_quant_layers(loaded)


# adapter_config.json keys whose value may differ from peft's default: the ones a plain LoRA adapter on
# qerl_kit's layers uses (init-time settings and bookkeeping included). Any other key (use_dora, bias,
# lora_bias, fan_in_fan_out, layer_replication, ...) changes the adapter's layers or forward in ways
# QuantLoraLinear does not implement, so it must keep peft's default value.
ADAPTER_KEYS = frozenset({
    "r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save", "use_rslora", "rank_pattern",
    "alpha_pattern", "layers_to_transform", "layers_pattern", "exclude_modules", "init_lora_weights",
    "inference_mode", "base_model_name_or_path", "revision", "peft_version", "task_type", "auto_mapping",
    "megatron_core", "qalora_group_size", "ensure_weight_tying"})
_WHY = {"use_dora": "DoRA is not supported on NVFP4 (4-bit) layers: it needs each layer's dense weight, "
                    "which a quantized layer does not hold"}


def check_adapter_config(config: LoraConfig) -> None:
    """A saved adapter's config with the rules of ``attach_lora``'s arguments (r, lora_alpha, lora_dropout,
    and every rank_pattern / alpha_pattern value), a LoRA of a causal LM, and no peft feature qerl_kit's
    quantized layers lack (``ADAPTER_KEYS``); a ``ConfigError`` naming the key otherwise."""
    check_lora_args(config.r, config.lora_alpha, config.lora_dropout, ("r", "lora_alpha", "lora_dropout"))
    for key, value in (config.rank_pattern or {}).items():
        check_rule(f"rank_pattern[{key!r}]", value, int, LORA_R_RULE)
    for key, value in (config.alpha_pattern or {}).items():
        check_rule(f"alpha_pattern[{key!r}]", value, float, LORA_ALPHA_RULE)
    if str(config.peft_type).rsplit(".", 1)[-1] != "LORA" or config.task_type not in (None, "CAUSAL_LM"):
        raise ConfigError(f"peft_type / task_type must be LORA / CAUSAL_LM (a LoRA adapter of a causal LM); got "
                          f"{short_repr(str(config.peft_type))} / {short_repr(config.task_type)}", "task_type")
    if config.init_lora_weights not in (True, False, "gaussian"):  # pissa, olora, loftq... change the base weights
        raise ConfigError(f"init_lora_weights must be true, false or 'gaussian' (other initialisations change the "
                          f"frozen base weights); got {short_repr(config.init_lora_weights)}", "init_lora_weights")
    default = LoraConfig()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name not in ADAPTER_KEYS and f.name not in ("peft_type",) and value != getattr(default, f.name):
            why = _WHY.get(f.name, "qerl_kit's LoRA layers over quantized weights do not implement it")
            raise ConfigError(f"{f.name}: {short_repr(value)} is not supported ({why}); a qerl_kit adapter keeps "
                              f"{f.name}: {short_repr(getattr(default, f.name))}", f.name, value)


def load_lora(model: torch.nn.Module, path: str, is_trainable: bool = False) -> PeftModel:
    """Load a saved peft adapter onto a (quantized) model, checked as a resume checks it."""
    config = lora_config_for(path)
    weights = read_adapter(path)  # the file must be there and readable before the model is wrapped
    config.inference_mode = not is_trainable  # as PeftModel.from_pretrained: a frozen adapter for inference
    peft_model = get_peft_model(model, config)
    try:
        load_adapter_weights(peft_model, path, weights)
    except Exception:
        peft_model.unload()  # the caller's model as it was, without the refused adapter's layers
        raise
    if not is_trainable:
        peft_model.eval()
    return peft_model


def trainable_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Counts of trainable and total parameters (packed 4-bit buffers are not parameters)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "total": total}
