"""Checkpoints of a training run: the adapter (peft, safetensors) plus everything to resume.

``checkpoint-<step>/`` holds ``adapter_model.safetensors`` + ``adapter_config.json`` (a standard
peft adapter; with trained norms they are inside it too) and ``trainer_state.pt``: optimizer,
lr scheduler, step, AQN state (its RNG), the RNG states, and the metrics so far. The state is
loaded with ``torch.load(weights_only=True)``: plain tensors and containers only, no pickled code.
A checkpoint is written to a temporary directory and renamed, so a crash never leaves half of one.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"
_PATTERN = re.compile(r"^checkpoint-(\d+)$")


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


def save_checkpoint(output_dir: str | Path, step: int, model, state: dict, keep: int = 2) -> Path:
    """Write ``checkpoint-<step>`` atomically and keep only the newest ``keep`` checkpoints."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{step}"
    tmp = root / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(checkpoint: str | Path) -> dict:
    return torch.load(Path(checkpoint) / STATE_FILE, weights_only=True)


def load_adapter_weights(model, checkpoint: str | Path) -> None:
    """Copy a saved adapter's tensors into the already-attached adapter of ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(Path(checkpoint) / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise ValueError(f"checkpoint {checkpoint} has adapter tensors the model lacks: {missing[:3]}")
