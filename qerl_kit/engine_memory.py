"""The StaticEngine's memory settings for a training run: ``rollout.keep_cache``, ``rollout.max_rows``
and ``rollout.share_weights``.

Two switches trade rollout speed for memory (``qerl_kit.rollout.static.engine``), and a third
trades none:

* ``keep_cache``: the engine keeps its KV cache and captured decode graphs from one rollout to the
  next (no re-allocation, no graph capture per step), so they stay allocated through the update;
  ``False`` frees them after each rollout and the update gets their memory back. Either way the
  rollouts are the same (tests/test_engine_memory.py).
* ``max_rows``: the most completions the engine decodes at once (whole groups); the KV cache holds
  that many rows and a larger batch is decoded in turns, at a lower throughput.
* ``share_weights``: the policy's q/k/v and gate/up tensors become row blocks of the engine's fused
  buffers instead of the engine holding a copy of them (two thirds of the linear weights: 10.7 GiB
  for a 32B NVFP4 model). The decode reads the same buffer (no speed cost expected); the policy's
  values stay as they are, only the storage of those tensors moves (``StaticEngine.restore_weights()``
  separates them again).

``None`` (auto, the default) lets ``choose`` pick them on a CUDA GPU from the memory plan of this run
(``qerl_kit.memory_plan.plan_memory``: the model's shape, ``model.format``, LoRA rank, optimizer,
``loss.micro_batch``, gradient checkpointing, the task's longest prompt, ``rollout.max_new_tokens``
and group size): the most rows whose planned peak fits the GPU's memory, the cache kept when it
still fits, the weights shared only where the copy is what does not fit (at each row count: the
cache kept with the copy, then kept with shared weights, then freed with the copy, then freed with
shared weights). The whole batch with the cache kept is the default wherever it fits; a 32B NVFP4
model at the paper's GSM8K recipe (128 x 4096 tokens, micro-batches of 8) decodes 88 of its 128
completions at a time with the cache freed and the weights shared when planned against 141 GB
(notebook 05, exercise 4; 80 with the engine's copy), 96 against the H200's 139.8 GiB as torch
reports it (88 with the copy). Under data parallelism each rank plans its own share of the batch
(``world``).
When no setting fits, the one with the smallest plan is taken (the plan is an upper bound, 1.1-1.3x
of measured peaks) and the warning says by how much it exceeds the GPU. A setting the config gives
is kept as given. Off a GPU nothing is planned: the whole batch, the cache kept.

The choice is a ``EngineMemory`` (``Trainer.engine_memory``) with a one-line ``reason``; a choice
other than the default (cache kept, whole batch) is also a warning, since it costs rollout time.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineMemory", "choose", "static_options", "CANDIDATES"]

CANDIDATES = 48  # most row counts planned (every whole number of groups up to it, else a geometric grid)


@dataclass(frozen=True)
class EngineMemory:
    """The StaticEngine settings a run uses: ``keep_cache``, ``max_rows`` (None: the whole batch), the
    planned peak in bytes (None when nothing was planned), why, in one line, and ``share_weights``."""

    keep_cache: bool
    max_rows: int | None
    planned_bytes: int | None
    reason: str
    share_weights: bool = False

    @property
    def is_default(self) -> bool:
        return self.keep_cache and self.max_rows is None and not self.share_weights

    @property
    def options(self) -> dict[str, Any]:
        """The StaticEngine keyword arguments of this choice."""
        return {"keep_cache": self.keep_cache, "max_rows": self.max_rows, "share_weights": self.share_weights}


def _group_counts(groups: int) -> list[int]:
    """Whole numbers of groups to plan, largest first: all of them up to ``CANDIDATES``, else a
    geometric grid from ``groups`` down to 1 (the plan is not monotone in rows: humming's repacked
    weights depend on the row counts, so the candidates are planned one by one, not bisected)."""
    if groups <= CANDIDATES:
        return list(range(groups, 0, -1))
    ratio = groups ** (1 / (CANDIDATES - 1))
    return sorted({max(1, round(groups / ratio ** k)) for k in range(CANDIDATES)}, reverse=True)


def _planner(config, shape, prompt_len: int, batch: int):
    """``plan(rows, keep) -> peak bytes`` for this run, or None (with the reason) when the model's
    config is not one the planner reads."""
    from qerl_kit.config_types import ConfigError
    from qerl_kit.memory_plan import model_shape, plan_memory

    try:
        model_shape(shape)
    except ConfigError as err:
        return None, f"no memory plan for this model ({err})"
    r, fmt = config.rollout, config.model.format
    humming = False
    if fmt == "nvfp4":
        from qerl_kit.kernels import nvfp4_humming

        humming = nvfp4_humming.humming_status()[0]
    settings = dict(fmt=fmt, lora_r=config.model.lora_r, optimizer=config.optim.optimizer,
                    rollout_batch=batch, group_size=r.group_size, prompt_len=max(1, prompt_len),
                    max_new_tokens=r.max_new_tokens, micro_batch=min(config.loss.micro_batch, batch),
                    gradient_checkpointing=config.model.gradient_checkpointing, engine="static", humming=humming)

    def plan(rows: int, keep: bool, share: bool = False) -> int:
        return int(plan_memory(shape, keep_cache=keep, max_rows=rows, share_weights=share, **settings).peak)

    try:  # a setting the planner refuses (a format it has no size for, say) must not stop the run
        plan(r.group_size, False)
    except (ConfigError, ValueError) as err:
        return None, f"no memory plan for this run ({err})"
    return plan, ""


def choose(config, policy=None, tokenizer=None, task=None, *, shape: Any = None, gpu_bytes: int | None = None,
           prompt_len: int | None = None, world: int = 1, warn: bool = True) -> EngineMemory:
    """The ``EngineMemory`` of a run (``config``: a TrainConfig) on ``policy``; see the module docstring.
    Without a policy (a plan before any download) give ``shape`` (a preset name of
    ``qerl_kit.models.PRESETS`` or a transformers config; default ``policy.config``), ``gpu_bytes``
    (default: the policy's CUDA device's total memory) and ``prompt_len`` (default: the task's longest
    prompt, ``Task.longest_prompt``). ``world``: data-parallel ranks; each decodes and trains on
    ``rollout.batch_size / world`` completions (``distributed.check_config`` has made that whole groups)."""
    from qerl_kit.table import human_bytes

    r = config.rollout
    if policy is None and (shape is None or gpu_bytes is None or (prompt_len is None and task is None)):
        raise ValueError("choose() without a policy needs shape=, gpu_bytes= and prompt_len= (or task and tokenizer)")
    share_given = bool(r.share_weights)  # what runs where nothing is planned: as configured, else not shared
    if r.keep_cache is not None and r.max_rows is not None and r.share_weights is not None:
        return EngineMemory(r.keep_cache, r.max_rows, None, "rollout.keep_cache, max_rows and share_weights as "
                            "configured", share_given)
    if gpu_bytes is None:
        device = next(policy.parameters()).device
        if device.type != "cuda":
            return EngineMemory(r.keep_cache is not False, r.max_rows, None, f"not planned on {device.type}",
                                share_given)
        import torch

        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    if prompt_len is None:
        prompt_len = task.longest_prompt(tokenizer)
    batch = r.batch_size // world  # this rank's completions
    plan, why = _planner(config, getattr(policy, "config", None) if shape is None else shape, prompt_len, batch)
    if plan is None:
        return EngineMemory(r.keep_cache is not False, r.max_rows, None, why, share_given)
    rows_options = [r.max_rows] if r.max_rows is not None else \
        [g * r.group_size for g in _group_counts(batch // r.group_size)]
    settings = [(keep, share) for keep in ([r.keep_cache] if r.keep_cache is not None else [True, False])
                for share in ([r.share_weights] if r.share_weights is not None else [False, True])]
    planned = []  # most rows first, then the order of ``settings``; planned until one fits (all when none does)
    for rows in rows_options:
        planned += [(rows, keep, share, plan(rows, keep, share)) for keep, share in settings]
        if any(c[-1] <= gpu_bytes for c in planned[-len(settings):]):
            break
    smallest = min(c[-1] for c in planned)
    budget = max(gpu_bytes, smallest)
    rows, keep, share, peak = next(c for c in planned if c[-1] <= budget)  # the first that fits
    max_rows = None if r.max_rows is None and rows >= batch else rows
    fits = f"planned peak {human_bytes(peak)} of the GPU's {human_bytes(gpu_bytes)}"
    if smallest > gpu_bytes:
        ckpt = "" if config.model.gradient_checkpointing else ", or turn on model.gradient_checkpointing"
        reason = (f"no setting fits: the smallest {fits} (the plan is an upper bound, 1.1-1.3x of measured "
                  f"peaks); lower loss.micro_batch or rollout.max_new_tokens{ckpt}, if the run runs out of memory")
    else:
        reason = fits
    choice = EngineMemory(keep, max_rows, peak, f"keep_cache={keep}, max_rows={max_rows}, share_weights={share}: "
                          f"{reason}", share)
    if warn and (not choice.is_default or smallest > gpu_bytes):
        warnings.warn(f"rollout (auto): {choice.reason}. {_cost(choice, batch, world)}", stacklevel=2)
    return choice


def _cost(choice: EngineMemory, batch: int, world: int) -> str:
    """What a non-default choice costs, and how to override it."""
    out = []
    if not choice.keep_cache:
        out.append("the KV cache is freed after each rollout and its decode graphs are captured again each step")
    if choice.max_rows is not None and choice.max_rows < batch:
        whose = "a step's" if world == 1 else "each rank's"
        out.append(f"{whose} {batch} completions are decoded {choice.max_rows} at a time")
    if choice.share_weights:
        out.append("the policy's q/k/v and gate/up tensors are stored in the engine's fused buffers instead of "
                   "beside them (same values; StaticEngine.restore_weights() separates them)")
    return ("; ".join(out) + ". " if out else "") + \
        "Set rollout.keep_cache / rollout.max_rows / rollout.share_weights to choose."


def static_options(config, policy, tokenizer, task, world: int = 1) -> tuple[dict[str, Any], EngineMemory | None]:
    """(the StaticEngine keyword arguments, the choice) when ``config.rollout.engine`` resolves to the
    StaticEngine on ``policy``; ({}, None) for another backend. ``world``: data-parallel ranks."""
    from qerl_kit.rollout.registry import resolve_engine

    r = config.rollout
    if resolve_engine(r.engine, policy) != "static":
        given = [f"rollout.{k}" for k in ("keep_cache", "max_rows", "share_weights") if getattr(r, k) is not None]
        if given:  # auto resolved to transformers' generate (the CPU): a GPU config runs here, without them
            warnings.warn(f"{' and '.join(given)} set the static engine; rollout.engine {r.engine!r} runs "
                          f"transformers' generate here, which ignores them", stacklevel=3)
        return {}, None
    choice = choose(config, policy, tokenizer, task, world=world)
    return choice.options, choice
