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
and releases the lock: processes meeting one new key together (DDP ranks) run one choice. A process
waits for the lock while its holder (the pid in the lock file) is alive on this machine, up to
``LOCK_CAP_S``; a holder it cannot see (another host on a shared file system) is waited for
``LOCK_WAIT_S``. A wait that ends without the lock is a warning; the process then reads the file
again and runs a stored choice if there is one, else times the key itself. The first writer wins:
a store never replaces an entry another process wrote meanwhile (it warns that this process ran a
different tile in that call, and the process takes the stored tile from its next call), nothing is
written without the lock, and a winner whose timing is inf (every candidate failed) is never
stored. A file that cannot be written is a warning (the choice holds in this process). A lone
candidate (pinned, stored) is not timed, so Triton's own fallback (a config that does not fit the
GPU times as inf) cannot see it fail: when its launch raises ``OutOfResources`` the wrapper warns,
drops it for this key in this process and launches the next candidate the kernel's pruning left
(the file is not changed). A damaged file (not JSON,
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
import math
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
LOCK_WAIT_S = 30.0   # the wait for a lock whose holder is not a live process of this machine
LOCK_CAP_S = 1800.0  # the longest wait for a live holder (timing every candidate of one key takes seconds)

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


def _alive(pid: str) -> bool:
    """Whether ``pid`` (as ``locks.holder`` read it) is a live process of this machine."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OSError:
        return False
    return True


def _lock(path: Path) -> int | None:
    """The file's ``flock`` (on ``<name>.lock``), waited for while its holder is alive here (up to
    ``LOCK_CAP_S``), else up to ``LOCK_WAIT_S``; None, with a warning, if not taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_name(path.name + ".lock")
    start = time.monotonic()
    fd = locks.try_lock(lock_path)
    while fd is None:  # another process is timing a key or writing
        waited, pid = time.monotonic() - start, locks.holder(lock_path)
        if waited >= LOCK_CAP_S or (waited >= LOCK_WAIT_S and not _alive(pid)):
            warnings.warn(f"the autotune cache lock {lock_path} is still held (process {pid}, "
                          f"{'alive' if _alive(pid) else 'not a live process of this machine'}) after {waited:.1f} s "
                          f"(waits: {LOCK_WAIT_S} s, {LOCK_CAP_S} s for a live holder); going on without it: a "
                          f"key the file lacks is timed here and its tile may differ from the holder's", stacklevel=3)
            return None
        time.sleep(0.02)
        fd = locks.try_lock(lock_path)
    return fd


def _store(path: Path, key: str, entry: dict, locked: bool = False, stale=None) -> dict | None:
    """Add one entry to the file under its lock (taken here unless the caller holds it: ``locked``),
    merged with the file as it is now, written atomically. The first writer wins: an entry for
    ``key`` already in the file is kept unless ``stale(its config)`` (no longer a candidate). Returns
    the file's entry for ``key`` after the call, or None when the lock was not taken (nothing is
    written: merging unlocked could drop another process's entry)."""
    fd = None if locked else _lock(path)
    if fd is None and not locked:
        return None
    try:
        entries = _read(path)
        old = entries.get(key)
        if old is not None and not (stale is not None and stale(old["config"])):
            _STORES[path] = entries
            return old
        entries[key] = entry
        file_writes.write_text_atomic(path, json.dumps({"format": FORMAT, "entries": entries}, indent=1,
                                                       sort_keys=True) + "\n")
        _STORES[path] = entries
        return entry
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
    lock held while timing, whether a launch is under way, whether the tensors are on the CPU, and
    for a lone (pinned or stored) choice the next candidates and the keys to drop it under if its
    launch does not fit the GPU."""

    pending: tuple | None = None
    candidates: int | None = None
    lock: int | None = None
    launching: bool = False
    on_cpu: bool = False
    fallback: tuple | None = None  # (entry key, Triton's key, [the next candidates])


def _triton_key(autotuner, named_args: dict, kwargs: dict) -> tuple:
    """The key of Triton's in-memory ``Autotuner.cache`` for a launch (as ``Autotuner.run`` builds it)."""
    args = {k: v for k, v in {**named_args, **kwargs}.items() if k in autotuner.arg_names}
    return tuple([args[k] for k in autotuner.keys if k in args] + [str(v.dtype) for v in args.values()
                                                                    if hasattr(v, "dtype")])


def _out_of_resources() -> tuple:
    """Triton's OutOfResources exception class (a tuple for ``except``; empty where it has none)."""
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - an older Triton
        return ()
    return (OutOfResources,)


class TunedKernel:
    """A ``triton.autotune`` kernel whose choice follows ``mode()``; launched like it: ``k[grid](...)``.
    Other attributes (``configs``, ``cache``, ``best_config``) are the Autotuner's."""

    def __init__(self, name: str, autotuner, prune, do_bench):
        self.name, self.autotuner, self._prune, self._do_bench = name, autotuner, prune, do_bench
        self._local = _LaunchState()
        self.timed = 0  # candidates timed in this process (0 once every choice comes from the file)
        self.failed: dict[str, list[dict]] = {}  # entry key -> configs whose launch did not fit, this process

    def __getattr__(self, attr):
        if attr == "autotuner":  # not set yet: no recursion
            raise AttributeError(attr)
        return getattr(self.autotuner, attr)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            while True:
                try:
                    return self._launch(grid, args, kwargs)
                except _out_of_resources() as err:
                    if not self._drop_unfit(err):
                        raise
        return launch

    def _launch(self, grid, args, kwargs):
        local = self._local
        local.pending, local.candidates, local.lock, local.launching, local.fallback = None, None, None, True, None
        try:
            out = self.autotuner[grid](*args, **kwargs)
            if local.pending is not None:
                self._record(*local.pending)
            return out
        finally:
            if local.lock is not None:
                locks.release(local.lock)
            local.pending, local.candidates, local.lock, local.launching = None, None, None, False

    def _drop_unfit(self, err: Exception) -> bool:
        """After a lone choice's launch raised OutOfResources: forget it for this key in this process
        and say which candidate runs next (True), or False when none is left (the error stands)."""
        fallback, self._local.fallback = self._local.fallback, None
        if not fallback or not fallback[2]:
            return False
        key, triton_key, rest = fallback
        bad = _plain(self.autotuner.best_config)
        self.failed.setdefault(key, []).append(bad)
        self.autotuner.cache.pop(triton_key, None)
        warnings.warn(f"{key}: tile {bad} does not fit this GPU ({err}); launching the next candidate "
                      f"{_plain(rest[0])} instead (the autotune cache file is not changed)", stacklevel=3)
        return True

    def choose(self, configs, named_args, **kwargs):
        """Triton's early_config_prune hook (called once per new key in a process): the kernel's own
        pruning, then the stored or pinned choice, or every candidate to be timed. Before timing, the
        file's lock is taken and the file read again: a process that meets the key meanwhile (another
        DDP rank) waits and then runs this one's choice; the lock is released after the store."""
        pruned = list(self._prune(configs, named_args, **kwargs) if self._prune else configs)
        chosen, how = pruned, mode()
        self._local.on_cpu = _device(named_args).type != "cuda"
        key = self.key(named_args, kwargs) if how != "time" else None
        failed = self.failed.get(key, []) if self.failed else []
        usable = [c for c in pruned if _plain(c) not in failed]  # [] once all failed: the error stands
        if how == "pinned" or (how == "cache" and failed):  # a lone choice that did not fit: the next one
            chosen = (usable or pruned)[:1]
        elif how == "cache" and len(pruned) > 1:
            path = cache_path()
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
                self._local.pending = (path, key, [_plain(c) for c in pruned],
                                       _triton_key(self.autotuner, named_args, kwargs))
        if how != "time" and len(chosen) == 1:
            self._local.fallback = (key, _triton_key(self.autotuner, named_args, kwargs),
                                    [c for c in usable if c is not chosen[0]])
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

    def _record(self, path: Path, key: str, candidates: list[dict], triton_key: tuple) -> None:
        """Store this process's timed choice, unless every candidate failed (inf) or another process
        stored one first (first writer wins: then this process takes the stored tile from its next
        call). A file that cannot be written (a read-only home, a full disk) is a warning, not a
        stopped run: the choice holds in this process, later ones time again."""
        best = self.autotuner.best_config
        timings = getattr(self.autotuner, "configs_timings", None) or {}
        medians = sorted(([_plain(c), _median(t)] for c, t in timings.items()), key=lambda e: e[1])
        if best in timings and not math.isfinite(_median(timings[best])):
            warnings.warn(f"{key}: every candidate failed to run (timings {medians}); nothing is stored", stacklevel=3)
            return
        entry = {"config": _plain(best), "stored": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "median_ms": medians}
        try:
            kept = _store(path, key, entry, locked=self._local.lock is not None,
                          stale=lambda config: config not in candidates)
        except OSError as err:
            kept, why = None, f"({err}); set {CACHE_ENV} to a writable file"
        else:
            why = "(its lock was not taken)"
        if kept is None:
            warnings.warn(f"the autotune cache {path} was not written {why}; {key} is timed again in the next "
                          f"process, whose tile choice may differ", stacklevel=3)
        elif kept["config"] != entry["config"]:  # another process stored first: take its tile from now on
            stored = next((c for c in self.autotuner.configs if _plain(c) == kept["config"]), None)
            if stored is not None:
                self.autotuner.cache[triton_key] = stored
            warnings.warn(f"{key}: another process stored tile {kept['config']} first; this call ran "
                          f"{entry['config']}, later calls of this process run the stored tile (the file keeps "
                          f"the first writer's)", stacklevel=3)


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
