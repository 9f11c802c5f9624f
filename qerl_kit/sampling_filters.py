"""DAPO's sampling-side helpers: dynamic sampling (group filtering) and overlong reward shaping.

Dynamic sampling (Yu et al. 2025, DAPO §3.2): a group whose G rewards are all equal has zero
advantage everywhere, so it adds no gradient and only dilutes the batch. DAPO drops such groups
and keeps generating until the batch holds ``target_groups`` groups with some reward spread.
``filter_groups`` says which groups to keep; ``accumulate_groups`` is the bookkeeping for the
rollout loop (it never generates anything itself). Like verl's ``filter_groups`` recipe, groups
beyond the target are discarded, and a round limit raises instead of looping forever, or, with
``exhausted="fill"`` (the Trainer's choice: a long run should not die on one hard batch), fills
the batch with the last round's groups that had no reward spread, counted in ``groups_filled``. Unlike
verl, groups of size 1 are rejected (verl keeps them; their GRPO advantage is 0 anyway).

Overlong reward shaping (DAPO §3.4, verl ``overlong_buffer``): 0 until the completion length
passes ``max_len - buffer_len``, then a linear penalty that reaches ``-penalty_factor`` at
``max_len`` and stays there beyond (verl never sees lengths above ``max_len``; the paper's
formula gives -1 there, which is what the floor reproduces).

Pure tensor/list code: no model, no tokenizer, no global state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

__all__ = ["filter_groups", "accumulate_groups", "KeptGroups", "overlong_penalty"]


def _as_float_1d(x, name: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float32)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {list(t.shape)}")
    return t.float()


def filter_groups(
    rewards: torch.Tensor,  # [B] group-contiguous (prompt 0's G samples first); NaN = unscorable
    group_size: int,
    *,
    atol: float = 0.0,
) -> torch.Tensor:          # [B / G] bool, True = keep
    """Keep a group when its non-NaN rewards are not all equal (max - min > atol).

    Groups with fewer than two non-NaN rewards are dropped. Expand to completions with
    ``keep.repeat_interleave(group_size)``.
    """
    r = _as_float_1d(rewards, "rewards")
    if int(group_size) != group_size or group_size < 2:
        raise ValueError(f"dynamic sampling needs group_size >= 2 (a group of one has no reward spread), got {group_size!r}")
    if r.numel() % group_size != 0:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, int(group_size))                                   # [N, G]
    valid = ~torch.isnan(g)
    hi = torch.where(valid, g, torch.full_like(g, -torch.inf)).max(dim=1).values
    lo = torch.where(valid, g, torch.full_like(g, torch.inf)).min(dim=1).values
    return ((hi - lo) > atol) & (valid.sum(dim=1) >= 2)


@dataclass(frozen=True)
class KeptGroups:
    """What dynamic sampling has kept so far. Immutable: ``accumulate_groups`` returns a new one."""

    groups: tuple = ()         # kept groups, each a tuple of G per-completion items (rollout order)
    rewards: tuple = ()        # matching tuples of G float rewards
    rounds: int = 0            # generation rounds consumed
    groups_seen: int = 0       # groups generated over all rounds
    groups_kept: int = 0       # groups that passed the filter (before truncation to the target)
    groups_filled: int = 0     # groups without reward spread taken at the round limit (exhausted="fill")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def keep_rate(self) -> float:
        """Share of generated groups that had reward spread (0.0 before the first round)."""
        return self.groups_kept / self.groups_seen if self.groups_seen else 0.0

    def items(self) -> list:
        """Kept completions flattened, group-contiguous: feed straight into the loss batch."""
        return [item for group in self.groups for item in group]

    def reward_tensor(self) -> torch.Tensor:  # [num_groups * G]
        return torch.tensor([r for group in self.rewards for r in group], dtype=torch.float32)


def accumulate_groups(
    state: KeptGroups,
    items: Sequence[Any],      # B per-completion payloads (dicts, indices, tensor rows, ...)
    rewards: torch.Tensor,     # [B]
    group_size: int,
    target_groups: int,
    *,
    max_rounds: int | None = None,
    atol: float = 0.0,
    exhausted: str = "raise",
) -> tuple[KeptGroups, bool]:  # (new state, target reached)
    """Add one generation round's groups that pass ``filter_groups``; stop at ``target_groups``.

    Call once per round with a fresh rollout; train on ``state.items()`` once it returns True.
    Groups past the target are discarded. With ``max_rounds`` set, a round that ends short of
    the target at ``rounds >= max_rounds`` raises ``RuntimeError`` (verl's ``max_num_gen_batches``),
    or with ``exhausted="fill"`` takes this round's other groups, in order, until the target.
    """
    if exhausted not in ("raise", "fill"):
        raise ValueError(f"exhausted must be 'raise' or 'fill'; got {exhausted!r}")
    r = _as_float_1d(rewards, "rewards")
    if len(items) != r.numel():
        raise ValueError(f"got {len(items)} items for {r.numel()} rewards; they must match one-to-one")
    if target_groups < 1:
        raise ValueError(f"target_groups must be >= 1, got {target_groups}")
    keep = filter_groups(r, group_size, atol=atol).tolist()
    G = int(group_size)
    items = list(items)
    new_groups, new_rewards = list(state.groups), list(state.rewards)
    for g, k in enumerate(keep):
        if k and len(new_groups) < target_groups:
            new_groups.append(tuple(items[g * G:(g + 1) * G]))
            new_rewards.append(tuple(r[g * G:(g + 1) * G].tolist()))
    filled = 0
    last = max_rounds is not None and state.rounds + 1 >= max_rounds
    if last and exhausted == "fill":
        for g, k in enumerate(keep):
            if not k and len(new_groups) < target_groups:
                new_groups.append(tuple(items[g * G:(g + 1) * G]))
                new_rewards.append(tuple(r[g * G:(g + 1) * G].tolist()))
                filled += 1
    new = replace(
        state,
        groups=tuple(new_groups),
        rewards=tuple(new_rewards),
        rounds=state.rounds + 1,
        groups_seen=state.groups_seen + len(keep),
        groups_kept=state.groups_kept + sum(keep),
        groups_filled=state.groups_filled + filled,
    )
    done = new.num_groups >= target_groups
    if not done and max_rounds is not None and new.rounds >= max_rounds:
        raise RuntimeError(
            f"dynamic sampling kept only {new.num_groups}/{target_groups} groups with reward spread after "
            f"{new.rounds} rounds (max_rounds={max_rounds}, keep rate {new.keep_rate:.1%}): the prompts are "
            "probably all too easy or all too hard. Raise max_rounds, change the data, or lower target_groups."
        )
    return new, done


def overlong_penalty(
    lengths,                     # [B] completion lengths in tokens (tensor or list)
    max_len: int,                # L_max: the generation cap
    buffer_len: int,             # L_cache: width of the soft-penalty zone before max_len
    penalty_factor: float = 1.0,
) -> torch.Tensor:               # [B] float32, in [-penalty_factor, 0]
    """DAPO soft overlong punishment, added to the task reward.

    0 for length <= max_len - buffer_len; ((max_len - buffer_len) - length) / buffer_len * factor
    inside the buffer zone (so -factor exactly at max_len); -factor beyond max_len.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (it is the size of the penalty), got {penalty_factor}")
    n = _as_float_1d(lengths, "lengths")
    exceed = n - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, min=-float(penalty_factor), max=0.0)
