"""What frames the training phases of one GRPO step: their clock, the dense-weight block around them,
what the prepare phase hands the update (``Prepared``) and the step's metrics after it.

* ``phase_clock(device)``: the host clock at a phase boundary. On CUDA it first waits for the work
  already queued (``torch.cuda.synchronize``), so ``time/logprob`` and ``time/update`` are the
  phases' own times, not the time it took to queue their kernels (the benchmarks read them). The
  Trainer reads it three times a step: before the log-prob phase, between it and the update, after
  the update. On the CPU a plain clock read.
* ``dense_block(model, config, batch, engine, groups)``: the step's ``dense_update.update_cache`` block,
  sized from the batch: ``tokens`` = the most tokens one of the step's micro-batches runs through the
  model once trimmed to its own width (``logprobs.widest_tokens``: the working set the block measures
  is that forward's, so its rate per token is not understated when micro-batches are narrower than
  the batch), ``max_tokens`` = micro-batch x (P + C) with C at ``rollout.max_new_tokens`` (a later
  batch's completions can reach the cap), and
  ``own_allocator`` when the engine keeps its own weights and memory (not a ``ModelEngine``: vLLM).
* ``step_metrics(prep, update, ...)``: the row the Trainer logs after the update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from qerl_kit import dense_update, grpo
from qerl_kit.logprobs import widest_tokens
from qerl_kit.old_policy import OldPolicy
from qerl_kit.rollout.base import ModelEngine
from qerl_kit.rollout.types import Rollouts

__all__ = ["Prepared", "synchronize", "phase_clock", "dense_block", "step_metrics"]


@dataclass
class Prepared:
    """What the update phase trains on: this rank's slice of the step's batch."""
    batch: Rollouts
    rewards: torch.Tensor      # [n] this rank's rewards
    all_rewards: torch.Tensor  # [W*n] the global batch's
    mask: torch.Tensor         # [n, C] float: completion tokens in the loss
    adv: torch.Tensor          # [n]
    old: OldPolicy             # the clean policy's log-probs, entropy, IS weights (filled by the update when folded)
    ref_logp: torch.Tensor | None
    ready_at: float            # phase_clock when the log-prob phase ended: the update's start
    groups: list               # each micro-batch's rows (logprobs.micro_batches: slices or row indices)
    bounds: list               # each micro-batch's padding_bounds (logprobs.micro_batch_plan), no read back per forward


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work when it is a CUDA device; nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phase_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished what was queued on it (a phase boundary)."""
    synchronize(device)
    return time.perf_counter()


def dense_block(model: torch.nn.Module, config: Any, batch: Any, engine: Any, groups=None, bounds=None):
    """The ``update_cache`` block of one step over ``batch`` (this rank's ``Rollouts``), as the
    module docstring sizes it; ``config`` a ``TrainConfig``; ``groups`` the step's micro-batches
    (``logprobs.micro_batches``, ``bounds`` their ``micro_batch_plan`` bounds), whose widest trimmed
    forward is ``tokens`` (default: micro-batch x the batch's P + C)."""
    rows, P, C = batch.completion_ids.shape[0], batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    micro = max(1, min(config.loss.micro_batch, rows))
    tokens = micro * (P + C) if groups is None else \
        widest_tokens(batch.prompt_mask, batch.completion_mask, groups, bounds)
    return dense_update.update_cache(model, config.model.dense_cache_gib, tokens=max(1, tokens),
                                     max_tokens=max(1, micro * (P + max(C, config.rollout.max_new_tokens))),
                                     own_allocator=not isinstance(engine, ModelEngine))


def step_metrics(prep: Prepared, update: dict, *, step: int, lr: float, temperature: float, dist: Any,
                 eps: tuple[float, float]) -> dict:
    """The step's metrics after the update (``update``: ``Trainer._update``'s loss, grad_norm, skipped and
    every forward's log-probs): the clip shares over every forward the loss clipped (TRL's: all ``mu``
    iterations, each micro-batch against the old policy; no extra pass), entropy, lengths; ``step`` the
    step's number (from 1), ``lr`` the scheduler's last, ``temperature`` the one this step sampled and
    scored at (a dashboard may change it between chunks), ``dist`` the Trainer's ``distributed.Context``,
    ``eps`` the clip range the loss used."""
    batch, mask, W, rows = prep.batch, prep.mask, dist.world, [sl for sl, _ in update["seen"]]
    out = grpo.clip_stats(torch.cat([lp for _, lp in update["seen"]]), torch.cat([prep.old.old_logp[sl] for sl in rows]),
                          torch.cat([prep.adv[sl] for sl in rows]), torch.cat([mask[sl] for sl in rows]), *eps)
    lengths = batch.completion_lengths.float()
    ent = dist.sum(torch.stack([(prep.old.entropy * mask).sum(), mask.sum()]).double())
    out.update({
        "step": step, "loss": update["loss"], "grad_norm": update["grad_norm"], "lr": lr,
        "update/skipped": update["skipped"], "rollout/temperature": temperature,
        "reward_std": prep.all_rewards.std().item() if prep.all_rewards.numel() > 1 else 0.0,
        "entropy": (ent[0] / ent[1].clamp(min=1)).item() if W > 1 else
        ((prep.old.entropy * mask).sum() / mask.sum().clamp(min=1)).item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/clipped_ratio": sum(r == "length" for r in batch.finish_reasons) / len(batch.finish_reasons),
        "num_tokens": int(batch.completion_mask.sum()),
    })
    if prep.ref_logp is not None:
        out["kl"] = grpo.kl_k3(prep.old.old_logp, prep.ref_logp, mask).item()
    return out
