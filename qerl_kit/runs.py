"""Run directories: what a training run writes into its ``output_dir``, and how a new run claims one.

A run writes only these names into its directory: ``run.json`` (its id, the command, when it
started), ``config.yaml``, ``metrics.jsonl``, ``checkpoint-<step>/`` (each with its own
``run.json``), ``.tmp-checkpoint-<step>/`` while one is written, ``config_changes.jsonl``,
``tensorboard/``, ``.old-checkpoint-<step>/`` while a checkpoint of the same step is replaced,
``.qerl-run.lock``, and for ``qerl demo`` ``summary.json`` and ``curves.png``. Other files in the
directory are never touched.

A directory belongs to one process: ``lock(dir)`` (called by ``claim``, and by ``qerl train`` before
the model loads) takes an exclusive ``flock`` on ``dir/.qerl-run.lock`` for the rest of the process's
life (``qerl_kit.locks``), so a second live process is refused at once (``RunLocked``, naming the
directory and the holder's pid), while a crashed run's lock goes with it. Within one process the
lock is re-entrant (a notebook may build a new Trainer on the same directory). ``lock`` first
checks the path: a dangling symlink or a file there is refused, naming it.

``claim(dir, run_id, command)`` is called before a run writes anything:

* no run there: it writes ``run.json`` and returns None;
* this run's ``run.json``: a resumed run, nothing to do;
* another run (its ``run.json``, or from before run.json existed: checkpoints with trainer
  state, a ``metrics.jsonl``, or a ``config.yaml`` of ours): that run's files move into
  ``dir/previous-runs/<time>-<id>/`` (nothing is deleted) and the new path is returned, for
  the caller to say so;
* our file names held by files that are not a run's (a ``config.yaml`` of your own): refused,
  ``FileExistsError`` naming them.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

from qerl_kit import locks

RUN_FILE = "run.json"
PREVIOUS = "previous-runs"
_FILES = ("run.json", "config.yaml", "metrics.jsonl", "config_changes.jsonl", "summary.json", "curves.png")
_DIRS = re.compile(r"^(checkpoint-\d+|\.(tmp|old)-checkpoint-\d+|tensorboard)$")
LOCK_FILE = ".qerl-run.lock"
_HELD: dict[str, int] = {}  # real path of a run directory -> the open, locked descriptor of its lock file


class RunLocked(FileExistsError):
    """Another live process holds the run directory."""


def check_output_dir(path: str | Path) -> None:
    """Refuse an output directory that cannot be one: a dangling symlink, or a non-directory."""
    root = Path(path)
    if root.is_symlink() and not root.exists():
        raise FileNotFoundError(f"output_dir {root} is a symlink to {os.readlink(root)}, which does not exist "
                                "(a dangling link); create its target or choose another output directory")
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"output_dir {root} exists and is not a directory; choose another output directory")


def lock(path: str | Path) -> None:
    """Make ``path`` this process's run directory for the rest of its life (see the module docstring)."""
    check_output_dir(path)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(root)
    if key in _HELD:
        try:  # still our lock file (the directory may have been deleted and made again since)
            if os.path.samestat(os.fstat(_HELD[key]), os.stat(root / LOCK_FILE)):
                return
        except OSError:
            pass
        locks.release(_HELD.pop(key))
    fd = locks.try_lock(root / LOCK_FILE)
    if fd is None:
        raise RunLocked(f"{root} is in use by another live run (process {locks.holder(root / LOCK_FILE)} holds "
                        f"{root / LOCK_FILE}); wait for it to finish or choose another output directory")
    _HELD[key] = fd

_CONFIG_KEYS = {"model", "rollout", "loss", "optim", "aqn"}  # a config.yaml of ours has these sections


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def read_run(path: str | Path) -> dict | None:
    """The ``run.json`` in ``path`` (a run or checkpoint directory), or None."""
    f = Path(path) / RUN_FILE
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def write_run(path: str | Path, run_id: str, command: str) -> None:
    info = {"run_id": run_id, "command": command, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (Path(path) / RUN_FILE).write_text(json.dumps(info, indent=1) + "\n")


def run_files(path: str | Path) -> list[Path]:
    """The entries of ``path`` that carry a run's names (what ``claim`` may move)."""
    root = Path(path)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p.is_file() and p.name in _FILES) or (p.is_dir() and _DIRS.match(p.name)))


def _ours(root: Path, files: list[Path]) -> bool:
    """Whether those files are a run's (not, say, a config.yaml of the user's own)."""
    if (root / RUN_FILE).is_file():
        return True
    if any(p.name.startswith("checkpoint-") and (p / "trainer_state.pt").is_file() for p in files):
        return True
    if (root / "metrics.jsonl").is_file() or (root / "summary.json").is_file():
        return True
    config = root / "config.yaml"
    if config.is_file():
        import yaml

        try:
            data = yaml.safe_load(config.read_text())
        except yaml.YAMLError:
            return False
        return isinstance(data, dict) and _CONFIG_KEYS <= set(data)
    return False


def claim(path: str | Path, run_id: str, command: str) -> Path | None:
    """Make ``path`` this run's directory (see the module docstring); the path another run's files
    were moved to, or None."""
    root = Path(path)
    lock(root)
    info = read_run(root)
    if info is not None and info.get("run_id") == run_id:
        return None
    files = run_files(root)
    moved = None
    if files:
        if not _ours(root, files):
            names = ", ".join(p.name for p in files[:5])
            raise FileExistsError(f"{root} holds {names}, which are not a qerl run's files; a run would write "
                                  "files of those names there: pick another output directory")
        old = (info or {}).get("run_id", "unknown")
        moved = root / PREVIOUS / f"{time.strftime('%Y%m%d-%H%M%S')}-{old}"
        n = 1
        while moved.exists():  # two claims in one second
            moved = moved.with_name(f"{moved.name}-{n}")
            n += 1
        moved.mkdir(parents=True)
        for p in files:
            p.rename(moved / p.name)
    write_run(root, run_id, command)
    return moved
