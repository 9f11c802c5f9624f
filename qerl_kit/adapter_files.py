"""The one checked loader of LoRA adapter files, and the error every checkpoint or adapter problem raises.

``read_adapter`` reads ``adapter_model.safetensors`` of a checkpoint or adapter directory (never a
download); ``load_adapter_weights`` copies it into a model's attached adapter after checking that it
holds exactly the model's adapter tensors, each of the model's shape, floating point and finite.
Resume (``qerl_kit.trainer_state.restore``) and ``qerl_kit.lora.load_lora`` (``qerl eval --adapter``,
``load_nvfp4(adapter_dir=)``) both use them; a problem is a ``CheckpointError`` naming the file (and
the tensor). It sits in the model layer so that lora needs nothing from the checkpoint layer above.
"""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_FILE = "adapter_model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint or adapter that cannot be used as it is (damaged, or not this model's)."""


def read_adapter(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of ``checkpoint/adapter_model.safetensors`` (a checkpoint or adapter directory);
    a missing or unreadable file is a ``CheckpointError`` naming it (never a download)."""
    from safetensors.torch import load_file

    path = Path(checkpoint) / ADAPTER_FILE
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint or adapter") from None
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type on truncated files
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}): "
                              "the file is damaged or truncated") from err


def load_adapter_weights(model, checkpoint: str | Path, weights: dict | None = None) -> None:
    """Copy a saved adapter's tensors (``weights``: already read by ``read_adapter``) into the
    already-attached adapter of ``model``, after checking that the checkpoint holds exactly the
    model's adapter tensors, each of the model's shape, floating point and finite."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    path = Path(checkpoint) / ADAPTER_FILE
    weights = read_adapter(checkpoint) if weights is None else weights
    expected = get_peft_model_state_dict(model)
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(expected) & set(weights) if tuple(expected[k].shape) != tuple(weights[k].shape))
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} adapter tensors missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensors the model has no place for (e.g. {unexpected[0]})")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} of another shape (e.g. {k}: {tuple(weights[k].shape)} in the checkpoint, "
                         f"{tuple(expected[k].shape)} in the model)")
        raise CheckpointError(f"{path} does not match the model's adapter: " + "; ".join(parts))
    ints = sorted(k for k, t in weights.items() if not t.is_floating_point())
    if ints:  # copying them in would cast silently: the values are not the adapter that was trained
        raise CheckpointError(f"{path} holds {len(ints)} tensors that are not floating point (e.g. {ints[0]}: "
                              f"{weights[ints[0]].dtype}); an adapter's LoRA matrices are floats")
    bad = sorted(k for k, t in weights.items() if not torch.isfinite(t).all())
    if bad:
        n = int((~torch.isfinite(weights[bad[0]])).sum())
        raise CheckpointError(f"{path} holds NaN or inf values in {len(bad)} of its {len(weights)} tensors (e.g. "
                              f"{bad[0]}: {n} of {weights[bad[0]].numel()} values); such an adapter cannot be used")
    set_peft_model_state_dict(model, weights)
