"""Data-parallel GRPO on ``torch.distributed``: the same ``Trainer``, launched by ``torchrun``.

``init()`` starts the default process group from the variables a launcher sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``: ``torchrun`` and
``accelerate launch`` both set them): NCCL with ``cuda:LOCAL_RANK`` when CUDA is available, gloo
on CPU. Without a launcher (``WORLD_SIZE`` unset or 1) every helper here is a no-op, so
single-process code runs unchanged.

What the ``Trainer`` does with a process group of W ranks (``Context``):

* every rank draws the same global prompt list of a step (seeded by (seed, step)) and keeps a
  contiguous slice of whole groups (``group_slice``): groups never split across ranks, and
  ``rollout.batch_size`` must be a multiple of W x ``group_size``;
* each rank samples its slice (seed of the call = f(seed, step, first global group), so ranks
  draw different samples), scores it, and the rewards of all ranks are gathered so that
  advantages (and the ``batch`` reward scale) are computed on the global batch;
* loss normalizers are global (DAPO's token count is all-reduced, GRPO's sequence count is
  W x the local one, Dr. GRPO's length is the max over ranks) and the adapter's gradients are
  all-reduced by ``DistributedDataParallel`` over the trainable parameters only (the 4-bit base
  is never broadcast); the loss is multiplied by W because DDP averages: the summed gradient is
  the single-process gradient of the same global batch;
* scalar metrics are reduced (``reduce_metrics``) so every rank holds the same row; only rank 0
  prints, writes ``metrics.jsonl``/TensorBoard and checkpoints (``is_main``).

``GroupSeededEngine`` wraps a rollout engine so each group is sampled under its own seed derived
from its global index: then a step's samples, and so the whole step, do not depend on the
world size (the CI equivalence test uses it; it gives up batching across groups in ``generate``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["init", "shutdown", "active", "rank", "world_size", "local_rank", "is_main", "device",
           "barrier", "Context", "group_slice", "check_config", "reduce_metrics", "GroupSeededEngine", "backward",
           "SEED_STRIDE"]

SEED_STRIDE = 1_000_003  # sampling-seed offset per global group index (0 for the first group)


# ---- process group ---------------------------------------------------------------------------
def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def active() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    return _env_int("LOCAL_RANK", 0)


def is_main() -> bool:
    """Rank 0 (or no process group): the one process that logs and writes checkpoints."""
    return rank() == 0


def device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init(backend: str | None = None) -> bool:
    """Start the process group from a launcher's environment; returns whether one is active.

    A no-op (returning False) when not launched (``WORLD_SIZE`` unset or 1); a no-op returning
    True when a process group already exists. ``backend`` defaults to NCCL with CUDA, else gloo
    (``QERL_DIST_BACKEND`` overrides it).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if _env_int("WORLD_SIZE", 1) <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = backend or os.environ.get("QERL_DIST_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        dev = device()
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(backend=backend, **kwargs)
    return dist.get_world_size() > 1


# The DistributedDataParallel wrappers ``wrap_ddp`` made and that are still alive: ``shutdown`` frees
# their reducers while the process group lives.
_WRAPPERS: "weakref.WeakSet" = weakref.WeakSet()


def shutdown() -> None:
    """Destroy the process group if one exists (call at the end of a launched script).

    First the reducers of the DDP wrappers ``wrap_ddp`` made (a Trainer's, even one the caller still
    holds) are freed, while the group lives: a reducer holds the group, and a group destroyed only
    later, when such a wrapper is freed, runs gloo's destructor with the GIL held, which joins worker
    threads that may need the GIL to free a finished barrier's tensors: a hang at exit, seen about
    once in five two-rank runs here (pytorch/pytorch#56297). The wrappers cannot run a step once
    the group is gone anyway."""
    if dist.is_available() and dist.is_initialized():
        for ddp in list(_WRAPPERS):
            for name in ("logger", "reducer"):  # the logger holds the reducer too
                ddp.__dict__.pop(name, None)
        _WRAPPERS.clear()
        gc.collect()  # wrappers in reference cycles, with their reducers, while the group lives
        dist.destroy_process_group()


def barrier() -> None:
    if active():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


# ---- the trainer's view --------------------------------------------------------------------------
@dataclass(frozen=True)
class Context:
    """Rank and world size as the Trainer sees them (world 1, rank 0 when not distributed)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def detect(cls) -> "Context":
        """The current process group's, starting it from the launcher's variables if needed."""
        init()
        return cls(rank(), world_size()) if active() else cls()

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def _comm_device(self, like: torch.Tensor) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors of all ranks along dim 0 (rank order); identity at W=1."""
        if not self.enabled:
            return x
        t = x.detach().to(self._comm_device(x)).contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts).to(x.device)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.SUM)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.MAX)

    def _reduce(self, x: torch.Tensor, op) -> torch.Tensor:
        if not self.enabled:
            return x
        t = x.detach().to(self._comm_device(x)).clone()
        dist.all_reduce(t, op=op)
        return t.to(x.device)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a stop button pressed on rank 0)."""
        if not self.enabled:
            return flag
        return bool(self.max(torch.tensor([1.0 if flag else 0.0])).item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            barrier()


def check_config(config, world: int) -> None:
    """Refuse what data parallelism over ``world`` ranks cannot do (yet), naming the fix."""
    r, fc = config.rollout, config.filters
    if world <= 1:
        return
    if r.batch_size % (world * r.group_size):
        raise ValueError(
            f"rollout.batch_size ({r.batch_size}) must be divisible by world_size x group_size "
            f"({world} x {r.group_size} = {world * r.group_size}): every rank takes whole groups "
            f"and the same number of them")
    if fc.dynamic_sampling:
        raise ValueError("filters.dynamic_sampling is not supported with more than one rank yet (the kept "
                         "groups would land unevenly on the ranks); run it on one process or turn it off")


def group_slice(n_groups: int, rank_: int, world: int) -> slice:
    """The contiguous slice of the global groups that ``rank_`` of ``world`` takes."""
    if world < 1 or not 0 <= rank_ < world:
        raise ValueError(f"rank {rank_} is not in a world of {world}")
    if n_groups % world:
        raise ValueError(f"{n_groups} groups do not split evenly over {world} ranks")
    per = n_groups // world
    return slice(rank_ * per, (rank_ + 1) * per)


# ---- metrics -------------------------------------------------------------------------------------
def _op(key: str) -> str:
    if key in ("loss", "num_tokens") or key.endswith("tokens_per_s"):
        return "sum"  # each rank holds its share of the global loss / token count / throughput
    if key.startswith(("time/", "memory/")) or key.endswith("_max") or key.endswith("/max"):
        return "max"  # a step takes as long as its slowest rank, and needs the memory of its fullest
    if key.endswith("_min") or key.endswith("/min"):
        return "min"
    return "mean"  # equal-sized slices: the mean of per-rank means is the global mean


def reduce_metrics(metrics: dict, ctx: Context) -> dict:
    """One row for all ranks: sums, max, min or means of every scalar (see ``_op``), key order kept.

    Every rank must hold the same keys (a mismatch is an error, not a hang). Token-weighted means
    (clip ratios, the IS statistics, kl) are averaged over ranks, exact when ranks hold equal
    token counts; reward, accuracy, reward_std and entropy are made exact by the Trainer.
    """
    if not ctx.enabled:
        return metrics
    keys = list(metrics)
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, keys)
    if any(k != keys for k in everyone):
        raise RuntimeError(f"ranks disagree on the metric keys: {everyone}")
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    out = {}
    for op, red in (("sum", dist.ReduceOp.SUM), ("mean", dist.ReduceOp.SUM),
                    ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        idx = [i for i, k in enumerate(keys) if _op(k) == op]
        if not idx:
            continue
        reduced = ctx._reduce(values[idx], red)
        if op == "mean":
            reduced = reduced / ctx.world
        for i, v in zip(idx, reduced.tolist()):
            out[keys[i]] = v
    for k in keys:
        if isinstance(metrics[k], bool) or not isinstance(metrics[k], int):
            continue
        out[k] = int(round(out[k]))
    return {k: out[k] for k in keys}


# ---- world-size-independent sampling ------------------------------------------------------------
class GroupSeededEngine:
    """Sample each group under its own seed: ``sampling.seed + j * SEED_STRIDE`` for the call's j-th group.

    The Trainer seeds a call with ``base + first_global_group * SEED_STRIDE``, so group g's seed is
    ``base + g * SEED_STRIDE`` whichever rank generates it and however many ranks there are: the
    samples of a step are the same on 1 or W ranks. One ``generate`` per group (no batching across
    groups), so use it for reproducibility checks, not for speed.
    """

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, sampling):
        import dataclasses

        from qerl_kit.rollout.types import Rollouts, as_prompts

        if sampling.seed is None:
            raise ValueError("GroupSeededEngine needs a seeded SamplingParams")
        prompts = as_prompts(prompts, getattr(self.engine, "tokenizer", None),
                             getattr(self.engine, "add_special_tokens", False))
        parts = [self.engine.generate(prompts[j:j + 1], n,
                                      dataclasses.replace(sampling, seed=sampling.seed + j * SEED_STRIDE))
                 for j in range(len(prompts))]
        return parts[0] if len(parts) == 1 else Rollouts.concat(parts)


def backward(loss: torch.Tensor, ctx: Context) -> None:
    """``loss.backward()`` for a micro-batch loss normalized by the *global* batch (all ranks' tokens or
    sequences): DDP averages the ranks' gradients, so the loss is scaled by W and the average becomes
    the sum, which is the single-process gradient of the same global batch."""
    (loss * ctx.world if ctx.world > 1 else loss).backward()


@contextlib.contextmanager
def no_sync(ddp, enabled: bool):
    """``ddp.no_sync()`` when ``enabled`` and ``ddp`` is a DDP module, else nothing."""
    if enabled and ddp is not None and hasattr(ddp, "no_sync"):
        with ddp.no_sync():
            yield
    else:
        yield


def wrap_ddp(model, ctx: Context):
    """``DistributedDataParallel`` over the trainable parameters of ``model`` only (None at W=1).

    Frozen parameters and buffers (the packed 4-bit base) are excluded from DDP's initial
    broadcast and its buffer syncs: each rank built the same base; the adapters start equal
    because ``attach_lora`` is seeded, and DDP's initial broadcast of them makes sure.
    """
    if not ctx.enabled:
        return None
    from torch.nn.parallel import DistributedDataParallel as DDP

    ignore = [n for n, p in model.named_parameters() if not p.requires_grad]
    ignore += [n for n, _ in model.named_buffers()]
    DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    dev = next(p for p in model.parameters() if p.requires_grad).device
    kwargs = dict(device_ids=[dev.index]) if dev.type == "cuda" else {}
    # the ignore list keeps every buffer out of DDP's init broadcast and per-forward buffer sync
    ddp = DDP(model, find_unused_parameters=False, **kwargs)
    _WRAPPERS.add(ddp)
    return ddp
