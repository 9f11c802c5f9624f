"""Checkpoints of a training run: the adapter (peft, safetensors) plus everything to resume.

``checkpoint-<step>/`` holds ``adapter_model.safetensors`` + ``adapter_config.json`` (a standard
peft adapter; with trained norms they are inside it too) and ``trainer_state.pt``: optimizer,
lr scheduler, step, AQN state (its RNG), the RNG states, and the metrics so far. The state is
loaded with ``torch.load(weights_only=True)``: plain tensors and containers only, no pickled code.
A checkpoint is written to a temporary directory and renamed, so a crash never leaves half of one;
one that replaces a checkpoint of the same step (the CLI's final save) first renames the old one to
``.old-checkpoint-<step>``, and ``latest_checkpoint`` puts it back if a crash came between the two
renames, so the run always keeps a complete checkpoint whatever ``keep_checkpoints`` is. A full
disk while writing is a ``file_writes.DiskFullError`` naming the path; the partial temporary
directory is removed and the earlier checkpoints stay as they were. The weights get the mode every
other file gets (``file_writes.match_umask``).
Each holds the ``run.json`` of the run that wrote it (``qerl_kit.runs``): pruning removes only
that run's older checkpoints. Loading checks what it reads: a missing, unexpected or wrongly
shaped adapter tensor, an integer or NaN/inf adapter tensor, a truncated file, or a trainer state missing
a key, holding one of the wrong type or a value a resume cannot use (``qerl_kit.trainer_state``), is a
``CheckpointError`` naming the file (and the tensor or key).
``qerl_kit.adapter_files.read_adapter`` and ``load_adapter_weights`` are the one
checked loader of adapter files: resume and ``qerl_kit.lora.load_lora`` (``qerl eval --adapter``,
``load_nvfp4(adapter_dir=)``) use them. What the state holds and how it is restored is
``qerl_kit.trainer_state``'s (this module builds on it; it knows nothing of this one).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from qerl_kit import file_writes, runs, trainer_state
from qerl_kit.adapter_files import CheckpointError
from qerl_kit.config_types import short_repr
from qerl_kit.trainer_state import STATE_FILE
_PATTERN = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _PATTERN.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def _finish_replacements(root: Path) -> None:
    """After a crash while a checkpoint replaced one of the same step: put the old one back where the
    new one never arrived, and delete it where the new one did (both are complete checkpoints)."""
    if not root.is_dir():
        return
    for old in root.iterdir():
        m = re.match(r"^\.old-checkpoint-(\d+)$", old.name)
        if m and old.is_dir() and (old / STATE_FILE).is_file():
            final = root / f"checkpoint-{m.group(1)}"
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.rename(final)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (after finishing a replacement a crash interrupted), or None."""
    _finish_replacements(Path(output_dir))
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def save_checkpoint(output_dir: str | Path, step: int, model, state: dict, keep: int = 2,
                    run_id: str | None = None) -> Path:
    """Write ``checkpoint-<step>`` atomically and keep only the newest ``keep`` checkpoints of the
    run ``run_id`` (other runs' checkpoints, and ones without a run id, are never removed)."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"checkpoint-{step}"
    if final.exists() and (runs.read_run(final) or {}).get("run_id") != run_id:
        raise CheckpointError(f"{final} exists and belongs to another run; it is left as it is")
    _finish_replacements(root)
    tmp = root / f".tmp-checkpoint-{step}"
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed write of this same checkpoint
    try:
        tmp.mkdir()
        model.save_pretrained(tmp)
        torch.save(state, tmp / STATE_FILE)
        if run_id is not None:
            runs.write_run(tmp, run_id, "checkpoint")
        file_writes.match_umask(tmp)  # safetensors writes 0600
    except Exception as err:  # noqa: BLE001 - torch.save reports a full disk as a RuntimeError
        full = file_writes.disk_full(err, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise file_writes.DiskFullError(f"{full}; checkpoint-{step} was not written, the earlier "
                                            f"checkpoints in {root} are intact") from err
        raise
    if final.exists():  # the same step saved again: the old one aside, the new in, the old deleted
        old = root / f".old-checkpoint-{step}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    if keep > 0 and run_id is not None:
        mine = [c for c in list_checkpoints(root) if (runs.read_run(c) or {}).get("run_id") == run_id]
        for old in mine[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _is_json(kind: type):
    def check(value) -> bool:
        try:
            return isinstance(json.loads(value), kind)
        except (TypeError, ValueError):
            return False
    return check


# key -> (what it must be, the check); "config" and "run_id" are optional (older checkpoints lack them)
_STATE_KEYS = {
    "step": ("a non-negative int", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "optimizer": ("an optimizer state dict (with 'state' and 'param_groups')",
                  lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list)),
    "scheduler": ("a scheduler state dict", lambda v: isinstance(v, dict)),
    "rng": ("a dict of 'torch' (a uint8 tensor) and 'python' RNG states",
            lambda v: isinstance(v, dict) and isinstance(v.get("torch"), torch.Tensor)
            and v["torch"].dtype == torch.uint8 and isinstance(v.get("python"), (list, tuple))),
    "aqn": ("a dict or None", lambda v: v is None or isinstance(v, dict)),
    "history": ("a JSON list of metric rows", _is_json(list)),
}
_OPTIONAL_KEYS = {"config": ("a JSON object", _is_json(dict)), "run_id": ("a string or None",
                                                                        lambda v: v is None or isinstance(v, str))}


def check_state(state, path: str | Path) -> dict:
    """``state`` if it is a trainer state with every key of the right type holding values a resume can
    use (``trainer_state.check_values``); else a ``CheckpointError`` naming ``path`` and the key."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a trainer state dict: the file is damaged")
    for key in _STATE_KEYS:
        if key not in state:
            raise CheckpointError(f"{path} lacks the key {key!r} of a trainer state: the file is damaged")
    for key, (allowed, ok) in {**_STATE_KEYS, **_OPTIONAL_KEYS}.items():
        if key in state and not ok(state[key]):
            raise CheckpointError(f"{path}: {key!r} must be {allowed}; got {short_repr(state[key], 60)}: the file is damaged")
    trainer_state.check_values(state, path)
    return state


def load_state(checkpoint: str | Path) -> dict:
    """The trainer state of a checkpoint; a missing, damaged or incomplete file names its path (and key)."""
    path = Path(checkpoint) / STATE_FILE
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {checkpoint} is not a complete checkpoint") from None
    except Exception as err:  # noqa: BLE001 - truncated or corrupt: torch raises several types
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}): "
                              "the file is damaged or truncated") from err
    return check_state(state, path)


# Config keys whose change does not alter the training computation: a resume may change them freely.
# loss.old_logp: fold and pass compute the same numbers (bit-equal on the CPU, tests/test_old_policy.py;
# on CUDA expected so and checked within tolerance); model.dense_cache_gib: the dense cache changes
# where the base weights are dequantized, not the results (bit-equal, tests/test_dense_update.py);
# rollout.keep_cache: a freed KV cache is allocated again, the rollouts are the same (tests/test_engine_memory.py);
# rollout.share_weights: where the fused projections are stored, not their values (tests/test_shared_weights.py);
# model.kernels: which kernels compute the same products (their rounding may differ, as on another GPU).
RESUME_NEUTRAL = frozenset({"output_dir", "save_every", "keep_checkpoints", "eval_every", "log_tensorboard",
                            "data.eval_size", "loss.old_logp", "model.dense_cache_gib", "model.kernels",
                            "rollout.keep_cache", "rollout.share_weights"})


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
