"""LoRA adapters on a frozen 4-bit base, through peft's custom-module dispatch.

``attach_lora(model, r=32)`` wraps every targeted ``QuantLinear`` (``NVFP4Linear`` and friends)
in ``QuantLoraLinear``, peft's own LoRA ``Linear`` with two changes: it reads in/out features
from the quantized layer, and it refuses to merge (adding a bf16 delta into packed 4-bit codes
would need a requantization and lose the delta). So ``get_peft_model``, ``save_pretrained`` and
``PeftModel.from_pretrained`` work as usual and the adapter files are standard peft adapters:
the same file loads onto a bf16 copy of the model with plain peft, and vLLM serves it.

Only the LoRA matrices train (and, with ``train_norms=True``, the RMSNorm scales in front of the
projections, as the official QeRL code does through peft's ``modules_to_save``). The reference
policy for a KL term needs no second model: ``with model.disable_adapter(): ...``.

peft does not store custom-module mappings in ``adapter_config.json``; to reload an adapter onto
a quantized model use ``load_lora(model, path)``. It reads the files through the checked loader
that resume uses (``qerl_kit.checkpoint.load_adapter_weights``), not ``PeftModel.from_pretrained``
(which falls back to the Hub for a missing file and silently leaves missing tensors at their
initial values): a missing directory or file, a truncated file, missing, extra or misshaped
tensors, or NaN/inf values are a ``CheckpointError`` naming the path (and the tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer

from qerl_kit.config_types import check_names, check_seed
from qerl_kit.linear import LINEAR_CLASSES, QuantLinear

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS_BEFORE_PROJECTIONS = ("input_layernorm", "post_attention_layernorm")


class QuantLoraLinear(PeftLoraLinear):
    """peft's LoRA Linear over a frozen quantized base: y = base(x) + B(A(dropout(x))) * scale."""

    def _get_in_out_features(self, module):
        base = module.get_base_layer() if isinstance(module, BaseTunerLayer) else module
        return base.in_features, base.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(
            "a LoRA adapter cannot be merged into a 4-bit base without requantizing it; keep it "
            "unmerged (the rollout engines apply it unmerged) or load the adapter onto a bf16 model "
            "and merge there")


def register_quant_layers(config: LoraConfig) -> LoraConfig:
    """Teach a peft LoraConfig to wrap qerl_kit's quantized layers (returns the same config)."""
    config._register_custom_module({cls: QuantLoraLinear for cls in LINEAR_CLASSES.values()})
    return config


def lora_config(r: int = 32, alpha: float | None = None, targets: Sequence[str] = ALL_PROJECTIONS,
                dropout: float = 0.0, train_norms: bool = False) -> LoraConfig:
    """A peft LoraConfig for a quantized causal LM (alpha defaults to r, i.e. a scale of 1)."""
    if r < 1:
        raise ValueError(f"LoRA rank r must be at least 1; got {r}")
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
    base's compute dtype, bf16 for a bf16 model). ``seed`` makes the A-matrix initialisation reproducible.
    """
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
    from qerl_kit.checkpoint import CheckpointError

    root = Path(path)
    config = root / "adapter_config.json"
    if not root.is_dir():
        raise CheckpointError(f"adapter {path} is not a directory (a peft adapter directory holds "
                              "adapter_config.json and adapter_model.safetensors)")
    if not config.is_file():
        raise CheckpointError(f"{config} is missing: {path} is not a peft adapter directory")
    try:
        return register_quant_layers(LoraConfig.from_pretrained(str(root)))
    except Exception as err:  # noqa: BLE001 - bad JSON, unknown keys: peft raises several types
        raise CheckpointError(f"{config} cannot be read as a LoRA config ({type(err).__name__}: "
                              f"{str(err)[:200]})") from err


def load_lora(model: torch.nn.Module, path: str, is_trainable: bool = False) -> PeftModel:
    """Load a saved peft adapter onto a (quantized) model, checked as a resume checks it."""
    from qerl_kit.checkpoint import load_adapter_weights, read_adapter

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
