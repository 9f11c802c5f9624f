"""Checkpoints of a training run: the adapter (peft, safetensors) plus everything to resume.

``checkpoint-<step>/`` holds ``adapter_model.safetensors`` + ``adapter_config.json`` (a standard
peft adapter; with trained norms they are inside it too) and ``trainer_state.pt``: optimizer,
lr scheduler, step, AQN state (its RNG), the RNG states, and the metrics so far. The state is
loaded with ``torch.load(weights_only=True)``: plain tensors and containers only, no pickled code.
A checkpoint is written to a temporary directory and renamed, so a crash never leaves half of one.
Each holds the ``run.json`` of the run that wrote it (``qerl_kit.runs``): pruning removes only
that run's older checkpoints. Loading checks what it reads: a missing, unexpected or wrongly
shaped adapter tensor, or a truncated file, is a ``CheckpointError`` naming the checkpoint.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import torch

from qerl_kit import runs

STATE_FILE = "trainer_state.pt"
ADAPTER_FILE = "adapter_model.safetensors"
_PATTERN = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from as it is (damaged, or not this model's)."""


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _PATTERN.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))


def _to_tuple(x):
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save_checkpoint(output_dir: str | Path, step: int, model, state: dict, keep: int = 2,
                    run_id: str | None = None) -> Path:
    """Write ``checkpoint-<step>`` atomically and keep only the newest ``keep`` checkpoints of the
    run ``run_id`` (other runs' checkpoints, and ones without a run id, are never removed)."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{step}"
    if final.exists() and (runs.read_run(final) or {}).get("run_id") != run_id:
        raise CheckpointError(f"{final} exists and belongs to another run; it is left as it is")
    tmp = root / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed write of this same checkpoint
    tmp.mkdir()
    model.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    if run_id is not None:
        runs.write_run(tmp, run_id, "checkpoint")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep > 0 and run_id is not None:
        mine = [c for c in list_checkpoints(root) if (runs.read_run(c) or {}).get("run_id") == run_id]
        for old in mine[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(checkpoint: str | Path) -> dict:
    """The trainer state of a checkpoint; a missing or damaged file names its path."""
    path = Path(checkpoint) / STATE_FILE
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint") from None
    except Exception as err:  # noqa: BLE001 - truncated or corrupt: torch raises several types
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}): "
                              "the file is damaged or truncated") from err


def load_adapter_weights(model, checkpoint: str | Path) -> None:
    """Copy a saved adapter's tensors into the already-attached adapter of ``model``, after checking
    that the checkpoint holds exactly the model's adapter tensors, each of the model's shape."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(checkpoint) / ADAPTER_FILE
    try:
        weights = load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint") from None
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error type on truncated files
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}): "
                              "the file is damaged or truncated") from err
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
    set_peft_model_state_dict(model, weights)


# Config keys whose change does not alter the training computation: a resume may change them freely.
RESUME_NEUTRAL = frozenset({"output_dir", "save_every", "keep_checkpoints", "eval_every", "log_tensorboard",
                            "data.eval_size"})


def config_changes(saved: dict, current: dict, defaults: dict | None = None, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (saved value, current value)} for every key that differs, but RESUME_NEUTRAL ones.
    A key the saved config lacks (added to the config since) counts as its value in ``defaults``."""
    out, defaults = {}, defaults or {}
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        a, b = saved.get(key, defaults.get(key)), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, defaults.get(key) if isinstance(defaults.get(key), dict) else {},
                                      f"{name}."))
        elif a != b and name not in RESUME_NEUTRAL:
            out[name] = (a, b)
    return out
