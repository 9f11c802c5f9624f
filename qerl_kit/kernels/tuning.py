"""Reproducible Triton autotuning: each autotuned kernel's tile choice is stored once and reused, or pinned.

``triton.autotune`` picks a kernel's config by timing every candidate in each new process. Two
processes can pick different tiles for the same shape (timings are noisy, the GPU may be shared),
and a different split of K or tile shape sums in a different order: the NVFP4 forward is then not
bitwise the same from run to run at a fixed seed. ``autotune(name, configs, key, ...)`` wraps
Triton's own ``Autotuner`` (its ``early_config_prune`` and ``do_bench`` hooks) so that the choice
is one of:

* ``cache`` (the default): the first process that meets a (kernel, key values, dtypes, GPU name,
  Triton version) times the candidates as Triton does and stores the winner in a JSON file; every
  later process (and every later call of this one) runs the stored config without timing.
* ``pinned``: no timing at all: the first candidate that survives the kernel's own pruning, the
  same on any machine; nothing is read or written.
* ``time``: Triton's plain behaviour (time in each process, store nothing).

The mode is ``$QERL_AUTOTUNE`` (``set_mode`` overrides it in a notebook); the file is
``$QERL_AUTOTUNE_CACHE``, else ``$XDG_CACHE_HOME/qerl_kit/autotune.json``, else
``~/.cache/qerl_kit/autotune.json`` (``set_cache_path`` overrides it). A process that meets a key
the file lacks takes the file's ``flock`` (``locks``), reads it again, times, stores the winner
(merged with what other processes stored, written atomically by ``file_writes.write_text_atomic``)
and releases the lock: processes meeting one new key together (DDP ranks) run one choice. A file
that cannot be written is a warning (the choice holds in this process). A damaged file (not JSON,
or not this module's layout) is refused with ``AutotuneCacheError`` naming its path, never
ignored: silently re-timing would change the bits the file exists to keep. A stored config that
is no longer a candidate (the kernel's config list changed) is re-timed and replaced. Choose the
mode before a process's first kernel call: Triton keeps each choice in memory for the rest of the
process (``reset()`` clears that, for tests).

Why not Triton's ``cache_results=True``: it is off under the interpreter (no CPU test could run
it), keys its files by a hash of the compiler, the backend (the architecture, not the GPU) and the
kernel's source inside Triton's kernel cache (one opaque file per shape, gone when that cache is
cleared or the source changes), reads a damaged file with a bare JSONDecodeError, and has no
timing-free mode. The autotuner itself (pruning, timing, the in-memory cache) is Triton's.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from pathlib import Path

from qerl_kit import file_writes, locks
from qerl_kit.config_types import check_value

__all__ = ["AUTOTUNE_ENV", "CACHE_ENV", "MODES", "AutotuneCacheError", "TunedKernel", "autotune", "cache_path",
           "entry_key", "mode", "reset", "set_cache_path", "set_mode", "TUNED"]

AUTOTUNE_ENV = "QERL_AUTOTUNE"
CACHE_ENV = "QERL_AUTOTUNE_CACHE"
MODES = ("cache", "pinned", "time")
FORMAT = 1  # the file's layout: {"format": 1, "entries": {key: entry}}
LOCK_WAIT_S = 30.0

_OVERRIDE: dict[str, object] = {}
_STORES: dict[Path, dict] = {}  # entries read from each file, this process
TUNED: dict[str, "TunedKernel"] = {}  # every kernel made by autotune(), by name


class AutotuneCacheError(ValueError):
    """The autotune cache file cannot be used; the message names the path and what to do."""


def mode() -> str:
    """The autotune mode: ``set_mode``'s, else ``$QERL_AUTOTUNE``, else "cache"."""
    if "mode" in _OVERRIDE:
        return _OVERRIDE["mode"]
    raw = os.environ.get(AUTOTUNE_ENV, "").strip()
    if not raw:
        return "cache"
    return check_value(AUTOTUNE_ENV, raw, str, choices=MODES, why="how Triton kernels choose their tiles")


def set_mode(value: str | None) -> None:
    """Use ``value`` (one of ``MODES``) in this process; None goes back to ``$QERL_AUTOTUNE``."""
    if value is None:
        _OVERRIDE.pop("mode", None)
    else:
        _OVERRIDE["mode"] = check_value("mode", value, str, choices=MODES, why="how Triton kernels choose tiles")


def cache_path() -> Path:
    """The JSON file of stored choices (see the module docstring for the order of lookups)."""
    if "path" in _OVERRIDE:
        return _OVERRIDE["path"]
    raw = os.environ.get(CACHE_ENV, "").strip()
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "qerl_kit" / "autotune.json"


def set_cache_path(path: str | os.PathLike | None) -> None:
    """Read and write stored choices at ``path`` in this process; None goes back to the default."""
    if path is None:
        _OVERRIDE.pop("path", None)
    else:
        _OVERRIDE["path"] = Path(path).expanduser()


def reset() -> None:
    """Forget every choice this process made or read (Triton's in-memory caches included)."""
    _STORES.clear()
    for kernel in TUNED.values():
        kernel.autotuner.cache.clear()


def gpu_name(device) -> str:
    """What the stored choice is for: the CUDA device's name, or the CPU interpreter."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)"


def _device(args: dict):
    """The device of the first tensor among a launch's arguments (the CPU when there is none)."""
    import torch

    return next((v.device for v in args.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))


def entry_key(kernel: str, values: dict, dtypes: list[str], gpu: str, triton_version: str) -> str:
    """The file's key of one choice: kernel, its autotune key values, the tensors' dtypes, GPU, Triton."""
    shape = ",".join(f"{k}={v}" for k, v in values.items())
    return f"{kernel}[{shape}][{','.join(dtypes)}] on {gpu} with triton {triton_version}"


def _damaged(path: Path, why: str) -> AutotuneCacheError:
    return AutotuneCacheError(f"the autotune cache {path} is damaged ({why}); delete it to time the kernels "
                              f"again (their tile choices may then change), or set {AUTOTUNE_ENV}=pinned")


def _read(path: Path) -> dict:
    """The entries stored at ``path`` ({} when there is no file); a damaged file is an error."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise _damaged(path, f"unreadable: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise _damaged(path, f"not JSON: {err}") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        raise _damaged(path, f"not an autotune cache of format {FORMAT}")
    for key, entry in data["entries"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
            raise _damaged(path, f"entry {key!r} has no config")
    return data["entries"]


def _stored(path: Path) -> dict:
    if path not in _STORES:
        _STORES[path] = _read(path)
    return _STORES[path]


def _lock(path: Path) -> int | None:
    """The file's ``flock`` (on ``<name>.lock``), waited for up to ``LOCK_WAIT_S``; None if not taken
    (then the caller goes on unlocked: the lock only orders the processes that time one key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + LOCK_WAIT_S
    fd = locks.try_lock(lock_path)
    while fd is None and time.monotonic() < deadline:  # another process is timing a key or writing
        time.sleep(0.02)
        fd = locks.try_lock(lock_path)
    return fd


def _store(path: Path, key: str, entry: dict, locked: bool = False) -> None:
    """Add one entry to the file, merged with the file as it is now, written atomically; under its
    lock (taken here unless the caller holds it: ``locked``)."""
    fd = None if locked else _lock(path)
    try:
        entries = _read(path)
        entries[key] = entry
        file_writes.write_text_atomic(path, json.dumps({"format": FORMAT, "entries": entries}, indent=1,
                                                       sort_keys=True) + "\n")
        _STORES[path] = entries
    finally:
        if fd is not None:
            locks.release(fd)


def _median(timing) -> float:
    """Triton's timing of one candidate (quantiles 0.5, 0.2, 0.8, or one number): its median, in ms."""
    return float(timing[0] if isinstance(timing, (list, tuple)) else timing)


def _match(configs: list, entry: dict | None) -> list:
    """[the config of ``configs`` that ``entry`` stores], or [] (no entry, or a config no longer listed)."""
    if entry is None:
        return []
    return [c for c in configs if _plain(c) == entry["config"]][:1]


def _plain(config) -> dict:
    """A triton.Config as JSON values (its kwargs, warps, stages, CTAs)."""
    return json.loads(json.dumps(config.all_kwargs()))


class _LaunchState(threading.local):
    """Per thread, during one launch: the key to store after timing, how many candidates are left, the
    lock held while timing, whether a launch is under way, whether the tensors are on the CPU."""

    pending: tuple | None = None
    candidates: int | None = None
    lock: int | None = None
    launching: bool = False
    on_cpu: bool = False


class TunedKernel:
    """A ``triton.autotune`` kernel whose choice follows ``mode()``; launched like it: ``k[grid](...)``.
    Other attributes (``configs``, ``cache``, ``best_config``) are the Autotuner's."""

    def __init__(self, name: str, autotuner, prune, do_bench):
        self.name, self.autotuner, self._prune, self._do_bench = name, autotuner, prune, do_bench
        self._local = _LaunchState()
        self.timed = 0  # candidates timed in this process (0 once every choice comes from the file)

    def __getattr__(self, attr):
        if attr == "autotuner":  # not set yet: no recursion
            raise AttributeError(attr)
        return getattr(self.autotuner, attr)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            local = self._local
            local.pending, local.candidates, local.lock, local.launching = None, None, None, True
            try:
                out = self.autotuner[grid](*args, **kwargs)
                if local.pending is not None:
                    self._record(*local.pending)
                return out
            finally:
                if local.lock is not None:
                    locks.release(local.lock)
                local.pending, local.candidates, local.lock, local.launching = None, None, None, False
        return launch

    def choose(self, configs, named_args, **kwargs):
        """Triton's early_config_prune hook (called once per new key in a process): the kernel's own
        pruning, then the stored or pinned choice, or every candidate to be timed. Before timing, the
        file's lock is taken and the file read again: a process that meets the key meanwhile (another
        DDP rank) waits and then runs this one's choice; the lock is released after the store."""
        pruned = list(self._prune(configs, named_args, **kwargs) if self._prune else configs)
        chosen, how = pruned, mode()
        self._local.on_cpu = _device(named_args).type != "cuda"
        if how == "pinned":
            chosen = pruned[:1]
        elif how == "cache" and len(pruned) > 1:
            path, key = cache_path(), self.key(named_args, kwargs)
            match = _match(pruned, _stored(path).get(key))
            if not match and self._local.launching:
                try:
                    self._local.lock = _lock(path)
                except OSError:  # no folder for the lock: _record warns when it cannot write either
                    self._local.lock = None
                _STORES[path] = _read(path)
                match = _match(pruned, _STORES[path].get(key))
                if match and self._local.lock is not None:
                    locks.release(self._local.lock)
                    self._local.lock = None
            if match:
                chosen = match
            else:
                self._local.pending = (path, key)
        self._local.candidates = len(chosen)
        return chosen

    def bench(self, fn, quantiles=None):
        """Triton's do_bench hook: a lone candidate is not timed (Triton times even one)."""
        if self._local.candidates == 1:
            return [0.0, 0.0, 0.0]
        self.timed += 1
        if self._local.on_cpu:  # the interpreter: Triton's timer needs a GPU driver
            start = time.perf_counter()
            fn()
            return [(time.perf_counter() - start) * 1e3] * 3
        return self._do_bench(fn, quantiles=quantiles)

    def key(self, named_args: dict, kwargs: dict) -> str:
        """``entry_key`` for a launch: Triton's own key (the key arguments' values and every tensor
        argument's dtype), plus the GPU and Triton's version."""
        import triton

        args = {k: v for k, v in {**named_args, **kwargs}.items() if k in self.autotuner.arg_names}
        values = {k: args[k] for k in self.autotuner.keys if k in args}
        dtypes = [str(v.dtype) for v in args.values() if hasattr(v, "dtype")]
        return entry_key(self.name, values, dtypes, gpu_name(_device(args)), triton.__version__)

    def _record(self, path: Path, key: str) -> None:
        """Store this process's timed choice; a file that cannot be written (a read-only home, a full
        disk) is a warning, not a stopped run: the choice holds in this process, later ones time again."""
        best = self.autotuner.best_config
        timings = getattr(self.autotuner, "configs_timings", None) or {}
        entry = {"config": _plain(best), "stored": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "median_ms": sorted(([_plain(c), _median(t)] for c, t in timings.items()), key=lambda e: e[1])}
        try:
            _store(path, key, entry, locked=self._local.lock is not None)
        except OSError as err:
            warnings.warn(f"the autotune cache {path} was not written ({err}); {key} is timed again in the next "
                          f"process, whose tile choice may differ (set {CACHE_ENV} to a writable file)", stacklevel=2)


def autotune(name: str, configs: list, key: list[str], prune=None, do_bench=None):
    """``triton.autotune(configs, key, prune_configs_by=..., do_bench=...)`` whose choice is stored or
    pinned (see the module docstring); ``prune`` is the kernel's own early_config_prune (or None).
    Returns a decorator of the ``@triton.jit`` (or heuristics-wrapped) kernel."""
    import triton

    def wrap(fn) -> TunedKernel:
        bench = do_bench or (lambda f, quantiles=None: triton.testing.do_bench(f, quantiles=quantiles))
        kernel = TunedKernel(name, None, prune, bench)
        kernel.autotuner = triton.autotune(configs, key, prune_configs_by={"early_config_prune": kernel.choose},
                                           do_bench=kernel.bench)(fn)
        TUNED[name] = kernel
        return kernel
    return wrap
