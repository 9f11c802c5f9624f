"""GRPO / DAPO / Dr. GRPO math on plain tensors: rewards -> advantages -> clipped policy loss.

One optimizer step, with G completions per prompt laid out group-contiguously (rows
``[g*G, (g+1)*G)`` belong to prompt ``g``):

1. ``combine_rewards``: r_i = sum_k w_k r_{k,i}, skipping "not applicable" (None/NaN) entries.
2. ``group_advantages``: A_i = (r_i - mean_group(r)) / (std + eps), std of the group (GRPO,
   Shao et al. 2024), of the whole batch, or no division at all (Dr. GRPO, Liu et al. 2025).
3. Per completion token t, with rho_t = exp(logp_t - old_logp_t):
   ``l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)``, optionally times a
   detached truncated-importance-sampling weight w_t (``importance_weights``, Yao et al. 2025)
   for the gap between the rollout engine's and the trainer's log-probs, plus
   ``beta * k3_t`` with k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (Schulman's k3).
4. Aggregation, the only difference between the three losses:
   ``grpo_loss`` = mean over sequences of (mean over that sequence's tokens),
   ``dapo_loss`` = sum over all tokens / number of tokens (DAPO, Yu et al. 2025),
   ``dr_grpo_loss`` = sum over all tokens / (B * T).

Where this departs from TRL's GRPOTrainer (snapshot f2cd577) or the papers:

- ``dapo_loss`` divides by the active tokens of the tensors it is given (TRL calls this "bnpo").
  TRL's "dapo" divides by the token count of the whole gradient-accumulation window across
  processes; pass that count as ``num_tokens=`` to get the same thing.
- ``dr_grpo_loss`` divides by the padded length T by default. TRL (and the Dr. GRPO paper) use
  a fixed constant (``max_completion_length``); pass ``max_len=`` for that.
- No gradient-accumulation scaling happens here: the caller divides by the number of micro-batches.
- The math runs in float32 whatever the input dtype. Padded positions are removed with
  ``torch.where`` before ``exp``, so -inf or garbage log-probs under the mask cannot produce NaN.
- ``old_logp``, ``ref_logp``, ``advantages`` and ``is_weights`` are detached: passing ``logp``
  itself as ``old_logp`` (the on-policy, mu = 1 case) gives the right gradient.
- ``combine_rewards`` sets a row where every function returned None to 0 and warns (TRL <= 0.2x).
  TRL now keeps such rows NaN so that they drop out of the group baseline and get advantage 0:
  ask for that with ``unscorable="nan"``; ``group_advantages`` is NaN-aware either way.
- ``frac_reward_zero_std`` always measures per-group std (TRL measures the batch std when
  ``scale_rewards="batch"``).
- ``importance_weights`` defaults to ``"token_truncate"`` (the TIS of Yao et al.), while TRL's
  config defaults to ``"sequence_mask"``: under AQN the rollout noise perturbs every token, and a
  sequence-level product over thousands of tokens leaves the [floor, cap] window for most rows.

Not here: entropy (computed with the logits elsewhere), sampling helpers (``sampling_filters``,
re-exported below).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .finite import NonFiniteError
from .sampling_filters import KeptGroups, accumulate_groups, filter_groups, overlong_penalty

__all__ = [
    "combine_rewards", "group_advantages", "frac_reward_zero_std",
    "grpo_loss", "dapo_loss", "dr_grpo_loss", "LOSSES", "LossSpec", "register_loss", "NORMALIZERS",
    "clip_stats", "kl_k3", "importance_weights", "IS_MODES",
    "filter_groups", "accumulate_groups", "KeptGroups", "overlong_penalty",
]

SCALES = ("group", "batch", "none")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# ----------------------------------------------------------------------------- rewards, advantages

def combine_rewards(
    per_fn: Sequence[Sequence[float | None]],  # F lists of B rewards (one list per reward function)
    weights: Sequence[float] | None = None,    # [F], default all 1
    *,
    unscorable: str = "zero",                  # "zero" | "nan": value of a row where all are None
    names: Sequence[str] | None = None,        # [F] the functions' names, for the error below
) -> torch.Tensor:                             # [B] float32
    """Weighted sum over reward functions with nansum semantics: None (or NaN) = not applicable.

    ``per_fn[k][i]`` is function k's reward for completion i. A completion for which every function
    returned None gets 0 (``unscorable="zero"``) or NaN (``"nan"``, TRL's current behaviour:
    ``group_advantages`` then leaves it out of the group mean/std and gives it advantage 0). Either
    way a ``UserWarning`` names the rows. A reward that is ±inf, or a weighted sum beyond float32's
    range (two functions returning 1e308), raises ``NonFiniteError`` naming the completion and each
    function's score: it would otherwise zero the group's advantages silently.
    """
    if unscorable not in ("zero", "nan"):
        raise ValueError(f"unscorable must be 'zero' or 'nan', got {unscorable!r}")
    if len(per_fn) == 0:
        raise ValueError("combine_rewards needs at least one reward function's list")
    lengths = {len(col) for col in per_fn}
    if len(lengths) != 1:
        raise ValueError(f"every reward function must score the same completions; got list lengths {sorted(lengths)}")
    table = torch.tensor(
        [[math.nan if v is None else float(v) for v in col] for col in per_fn], dtype=torch.float64
    )  # [F, B]; float64, so a sum that leaves float32's range is seen before it becomes inf
    if weights is None:
        w = torch.ones(len(per_fn))
    else:
        w = torch.as_tensor(weights, dtype=torch.float64).flatten()
        if w.numel() != len(per_fn):
            raise ValueError(f"got {w.numel()} weights for {len(per_fn)} reward functions")
    total = (w[:, None] * table).nansum(dim=0)  # [B]
    _check_combined(total, table, names)
    none_rows = torch.isnan(table).all(dim=0)   # [B]
    if bool(none_rows.any()):
        idx = none_rows.nonzero().flatten().tolist()
        fill = 0.0 if unscorable == "zero" else math.nan
        warnings.warn(
            f"every reward function returned None for completion(s) {idx}; their reward is set to {fill}. "
            "Make sure at least one reward function scores every completion.",
            stacklevel=2,
        )
        total[none_rows] = fill
    return total.float()


def _check_combined(total: torch.Tensor, table: torch.Tensor, names: Sequence[str] | None) -> None:
    """Every combined reward finite within float32's range (where advantages are computed)."""
    bad = ~(total.abs() <= torch.finfo(torch.float32).max)
    bad &= ~torch.isnan(table).all(dim=0)  # a row no function scored is handled (and said) below
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0])
    names = list(names) if names is not None else [f"reward function {k}" for k in range(table.shape[0])]
    parts = ", ".join(f"{n}={table[k, i].item():.6g}" for k, n in enumerate(names))
    raise NonFiniteError(f"the combined reward of completion {i} is {total[i].item():.6g} ({parts}): rewards must be "
                         f"finite and their weighted sum within float32's range (|r| <= 3.4e38); scale the reward "
                         "function(s) down")


def _nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased (Bessel, N-1) std ignoring NaN, like TRL's ``nanstd``: NaN where < 2 values."""
    if dim is None:
        x, dim = x.flatten(), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.full_like(var, math.nan))
    return std if keepdim else std.squeeze(dim)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:  # [B] -> [B/G, G]
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {list(rewards.shape)}")
    if int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}: rewards must hold "
            "whole groups, laid out group-contiguously (prompt 0's G samples first)"
        )
    return rewards.double().view(-1, int(group_size))  # float64: large rewards' squares do not overflow


def group_advantages(
    rewards: torch.Tensor,  # [B], group-contiguous; NaN = unscorable
    group_size: int,
    scale: str = "group",   # "group" (GRPO, TRL default) | "batch" | "none" (Dr. GRPO)
    eps: float = 1e-4,
) -> torch.Tensor:          # [B] float32
    """A = r - group mean, divided by (std + eps) of the group, of the batch, or not at all.

    std is unbiased (N-1), as in TRL (``nanstd`` with Bessel's correction). NaN rewards are left
    out of the means and stds; their advantage, and any advantage that comes out NaN (a group with
    fewer than two scorable rewards under ``"group"``), is 0. ``"batch"`` uses the std of the raw
    rewards over the whole batch, as TRL does; the mean is still the group mean.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    r = _grouped(rewards, group_size)                        # [N, G]
    if bool(torch.isinf(r).any()):  # r - mean would be NaN, then 0: the group's signal lost silently
        i = int(torch.isinf(r).flatten().nonzero()[0])
        raise NonFiniteError(f"reward {i} is {r.flatten()[i].item()}; rewards must be finite (None/NaN = unscorable)")
    adv = r - torch.nanmean(r, dim=1, keepdim=True)          # [N, G]
    if scale == "group":
        adv = adv / (_nanstd(r, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (_nanstd(r) + eps)
    adv = adv.flatten().float()
    return torch.where(torch.isnan(adv), torch.zeros_like(adv), adv)


def frac_reward_zero_std(rewards: torch.Tensor, group_size: int) -> float:  # rewards [B]
    """Share of groups whose reward std is (close to) 0, i.e. that carry no learning signal.

    TRL's ``frac_reward_zero_std`` with per-group std. A group with fewer than two non-NaN rewards
    has an undefined (NaN) std and is not counted, as in TRL.
    """
    std = _nanstd(_grouped(rewards, group_size), dim=1)  # [N]
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()


# ----------------------------------------------------------------------------- validation

def _check(name: str, x, shape: tuple[int, ...], what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(x.shape)}")


def _active(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate logp/mask; return (bool mask [B, T], float32 mask [B, T])."""
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        shape = list(logp.shape) if isinstance(logp, torch.Tensor) else type(logp).__name__
        raise ValueError(f"logp must be a [B, T] tensor of per-token log-probs, got {shape}")
    _check("mask", mask, tuple(logp.shape), "[B, T] like logp")
    active = mask != 0
    return active, active.float()


def _eps(eps_low: float, eps_high: float | None) -> tuple[float, float]:
    eps_high = eps_low if eps_high is None else eps_high
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    return float(eps_low), float(eps_high)


# ----------------------------------------------------------------------------- losses

def _per_token_loss(logp, old_logp, advantages, mask, eps_low, eps_high, ref_logp, beta, is_weights):
    """Per-token objective [B, T] (float32, zero where mask is 0) and the float mask [B, T]."""
    active, m = _active(logp, mask)
    shape = tuple(logp.shape)
    _check("old_logp", old_logp, shape, "[B, T] like logp")
    _check("advantages", advantages, shape[:1], "[B] (one per sequence)")
    eps_low, eps_high = _eps(eps_low, eps_high)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 adds a KL penalty to the reference policy, so ref_logp ([B, T]) is required")
    lp = logp.float()
    log_ratio = torch.where(active, lp - old_logp.detach().float(), 0.0)  # [B, T]
    ratio = torch.exp(log_ratio)
    a = advantages.detach().float().unsqueeze(1)                          # [B, 1]
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * a, clipped * a)                          # [B, T]
    if is_weights is not None:
        _check("is_weights", is_weights, shape, "[B, T] like logp")
        loss = loss * is_weights.detach().float()
    if beta > 0:
        _check("ref_logp", ref_logp, shape, "[B, T] like logp")
        d = torch.where(active, ref_logp.detach().float() - lp, 0.0)       # [B, T]
        loss = loss + beta * (torch.exp(d) - d - 1.0)
    return torch.where(active, loss, 0.0), m


def grpo_loss(
    logp: torch.Tensor,        # [B, T] current policy log-probs of the sampled tokens (requires grad)
    old_logp: torch.Tensor,    # [B, T] log-probs of the policy that generated the batch (detached)
    advantages: torch.Tensor,  # [B]
    mask: torch.Tensor,        # [B, T] 1 = completion token in the loss, 0 = padding
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,       # None = eps_low
    ref_logp: torch.Tensor | None = None,  # [B, T], needed when beta > 0
    beta: float = 0.0,
    is_weights: torch.Tensor | None = None,  # [B, T] rollout-correction weights (detached)
) -> torch.Tensor:             # scalar
    """GRPO (Shao et al. 2024): mean over each sequence's tokens, then mean over the B sequences.

    Each sequence weighs the same, so a token of a short completion weighs more than one of a long
    completion (the length bias Dr. GRPO points out). A sequence with an all-zero mask adds 0 but
    still counts in the mean over B, as in TRL.
    """
    loss, m = _per_token_loss(logp, old_logp, advantages, mask, eps_low, eps_high, ref_logp, beta, is_weights)
    return (loss.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)).mean()


def dapo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,  # as grpo_loss
    *,
    eps_low: float = 0.2,
    eps_high: float | None = 0.28,       # DAPO's clip-higher
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,     # normalizer; None = active tokens in mask
) -> torch.Tensor:
    """DAPO token-level loss (Yu et al. 2025): sum over all active tokens / number of tokens.

    Every token weighs the same. Pass ``num_tokens`` (the active tokens of the whole
    gradient-accumulation window) to get TRL's ``loss_type="dapo"`` across micro-batches.
    """
    loss, m = _per_token_loss(logp, old_logp, advantages, mask, eps_low, eps_high, ref_logp, beta, is_weights)
    denom = m.sum().clamp(min=1.0) if num_tokens is None else max(float(num_tokens), 1.0)
    return loss.sum() / denom


def dr_grpo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,  # as grpo_loss
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weights: torch.Tensor | None = None,
    max_len: int | None = None,          # constant length normalizer; None = padded T
) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): sum over all active tokens / (B * max_len), max_len = T by default.

    The normalizer does not depend on completion lengths, which removes GRPO's length bias; pair
    it with ``group_advantages(..., scale="none")`` for the full Dr. GRPO recipe.
    """
    loss, m = _per_token_loss(logp, old_logp, advantages, mask, eps_low, eps_high, ref_logp, beta, is_weights)
    length = logp.shape[1] if max_len is None else int(max_len)
    if length < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    return loss.sum() / (logp.shape[0] * length)


# ----------------------------------------------------------------------------- the registry

NORMALIZERS = ("tokens", "sequences", "length")


@dataclass(frozen=True)
class LossSpec:
    """A loss as the Trainer uses it: the function and what it divides by.

    The Trainer computes one step's loss in micro-batches, on every rank, and wants the gradient of
    the *global* batch's loss. ``normalizer`` says how:

    * ``"tokens"``: ``fn(..., num_tokens=N)`` divides by the global batch's N active tokens, so
      micro-batch losses add up to the global one (DAPO);
    * ``"sequences"``: ``fn`` is a mean over its rows, so a micro-batch of b rows is weighted
      b / (global rows) (GRPO);
    * ``"length"``: ``fn(..., max_len=L)`` divides by rows x L with L the global batch's widest
      completion, weighted like ``"sequences"`` (Dr. GRPO).
    """

    fn: Callable[..., torch.Tensor]
    normalizer: str

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"a loss must be callable; got {self.fn!r}")
        if self.normalizer not in NORMALIZERS:
            raise ValueError(f"normalizer must be one of {NORMALIZERS}; got {self.normalizer!r}")

    def batch_kwargs(self, num_tokens: torch.Tensor | float, max_len: int) -> dict:
        """The keyword the function takes for the global batch's normalizer (none for "sequences")."""
        return {"tokens": {"num_tokens": num_tokens}, "sequences": {},
                "length": {"max_len": int(max_len)}}[self.normalizer]

    def chunk_weight(self, rows: int, global_rows: int) -> float:
        """What one micro-batch's loss is multiplied by so that the chunks add up to the global loss."""
        return 1.0 if self.normalizer == "tokens" else rows / global_rows


LOSSES: dict[str, LossSpec] = {"grpo": LossSpec(grpo_loss, "sequences"), "dapo": LossSpec(dapo_loss, "tokens"),
                               "dr_grpo": LossSpec(dr_grpo_loss, "length")}


def register_loss(name: str, fn: Callable[..., torch.Tensor], normalizer: str) -> LossSpec:
    """Make ``name`` a value of ``loss.loss``. ``fn(logp, old_logp, advantages, mask, *, eps_low,
    eps_high, beta, ref_logp, is_weights, **normalizer keyword)`` returns a scalar; see ``LossSpec``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a loss name must be a non-empty string; got {name!r}")
    LOSSES[name] = spec = LossSpec(fn, normalizer)
    return spec


# ----------------------------------------------------------------------------- diagnostics

@torch.no_grad()
def clip_stats(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,  # [B,T],[B,T],[B],[B,T]
    eps_low: float = 0.2,
    eps_high: float | None = None,
) -> dict[str, float]:
    """Share of tokens whose gradient the clip removes, with TRL's metric names and semantics.

    low = ratio < 1 - eps_low and A < 0; high = ratio > 1 + eps_high and A > 0; region = either.
    ``*_mean`` are token means over the mask; ``clip_ratio/low_min`` and ``clip_ratio/high_max``
    are the min/max over sequences of the per-sequence token mean (empty sequences skipped).
    """
    active, m = _active(logp, mask)
    _check("old_logp", old_logp, tuple(logp.shape), "[B, T] like logp")
    _check("advantages", advantages, tuple(logp.shape[:1]), "[B] (one per sequence)")
    eps_low, eps_high = _eps(eps_low, eps_high)
    ratio = torch.exp(torch.where(active, logp.float() - old_logp.float(), 0.0))
    a = advantages.float().unsqueeze(1)
    low = ((ratio < 1 - eps_low) & (a < 0) & active).float()
    high = ((ratio > 1 + eps_high) & (a > 0) & active).float()
    n_tok = m.sum().clamp(min=1.0)
    n_seq = m.sum(dim=1)
    nonempty = n_seq > 0
    seq_low = (low.sum(1) / n_seq.clamp(min=1.0))[nonempty]
    seq_high = (high.sum(1) / n_seq.clamp(min=1.0))[nonempty]
    return {
        "clip_ratio/low_mean": (low.sum() / n_tok).item(),
        "clip_ratio/high_mean": (high.sum() / n_tok).item(),
        "clip_ratio/region_mean": (torch.maximum(low, high).sum() / n_tok).item(),
        "clip_ratio/low_min": seq_low.min().item() if seq_low.numel() else 0.0,
        "clip_ratio/high_max": seq_high.max().item() if seq_high.numel() else 0.0,
    }


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [B,T] x3 -> scalar
    """Token mean over the mask of k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0); TRL's ``kl`` metric."""
    active, m = _active(logp, mask)
    _check("ref_logp", ref_logp, tuple(logp.shape), "[B, T] like logp")
    d = torch.where(active, ref_logp.float() - logp.float(), 0.0)
    return ((torch.exp(d) - d - 1.0) * m).sum() / m.sum().clamp(min=1.0)


@torch.no_grad()
def importance_weights(
    train_old_logp: torch.Tensor,  # [B, T] log-probs of the sampled tokens under the training model
    rollout_logp: torch.Tensor,    # [B, T] log-probs the rollout engine (quantized, noised) sampled with
    mask: torch.Tensor,            # [B, T]
    mode: str = "token_truncate",
    cap: float | None = 3.0,       # C_max; None = no upper bound
    floor: float | None = None,    # C_min; None = no lower bound
    stats: bool = True,            # False: the weights alone, {} for stats (no host sync)
) -> tuple[torch.Tensor, dict[str, float]]:  # weights [B, T] (0 on padding), stats
    """Truncated / masked importance-sampling weights for the rollout-vs-training mismatch.

    rho = pi_train_old / pi_rollout, per token (``token_*``) or per sequence as
    exp(sum_t log-ratio) broadcast to its tokens (``sequence_*``). ``*_truncate`` clamps rho to
    [floor, cap]; ``*_mask`` sets rho to 0 outside it (TRL's ``vllm_importance_sampling_*``).
    Pass the result as ``is_weights=`` to a loss; it multiplies the policy term (not the KL).
    Stats use TRL's names; the ratio stats are taken after truncation/masking, over active tokens
    (token modes) or over all B sequences (sequence modes), as TRL does. ``stats=False`` returns the
    same weights with ``{}``: no statistic is reduced, so nothing waits for the device (five
    ``.item()`` syncs fewer; ``OldPolicy.fill`` per micro-batch).
    """
    active, m = _active(train_old_logp, mask)
    _check("rollout_logp", rollout_logp, tuple(train_old_logp.shape), "[B, T] like train_old_logp")
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    if cap is not None and floor is not None and floor > cap:
        raise ValueError(f"floor ({floor}) must be <= cap ({cap})")
    diff = torch.where(active, train_old_logp.float() - rollout_logp.float(), 0.0)  # [B, T]
    seq = mode.startswith("sequence")
    rho = torch.exp(diff.sum(dim=1, keepdim=True) if seq else diff)  # [B, 1] or [B, T]
    if mode.endswith("truncate"):
        if floor is not None or cap is not None:
            rho = torch.clamp(rho, min=floor, max=cap)
    else:
        lo = -math.inf if floor is None else floor
        hi = math.inf if cap is None else cap
        rho = rho.masked_fill((rho < lo) | (rho > hi), 0.0)
    weights = rho.expand_as(diff) * m
    if not stats:
        return weights, {}
    delta = diff.abs()[active]
    flat = rho.flatten() if seq else rho[active]

    def _stat(x: torch.Tensor, fn) -> float:
        return fn(x).item() if x.numel() else 0.0

    out = {
        "sampling/sampling_logp_difference/mean": _stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": _stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": _stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": _stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": _stat(flat, torch.max),
    }
    return weights, out
