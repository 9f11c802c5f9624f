"""The rollout contract's data: what goes into an engine and what comes out.

* ``SamplingParams``: max_new_tokens, temperature (0 = greedy), top-p, top-k, seed.
* ``Prompts``: a batch of prompts as token ids (what every engine consumes) with the texts they
  were rendered from (what reward functions and tables show). ``Prompts.encode(tokenizer, texts)``
  is the one place a prompt is tokenized: ``add_special_tokens=False`` by default, as TRL does,
  since chat-templated prompts already hold their special tokens.
* ``Generation``: token-level output of one call, group-contiguous rows (prompt i's n samples are
  rows i*n .. i*n+n-1): left-padded prompt ids and mask, right-padded completion ids, mask and
  per-token sampling log-probs, which rows stopped, and backend timings. No text.
* ``Rollouts``: a ``Generation`` plus decoded texts, finish reasons and the group size, in the
  layout ``qerl_kit.grpo.group_advantages`` expects.

Log-prob semantics: ``logprobs[r, t]`` is log pi_sample(token_t | prefix), where pi_sample is the
distribution the token was drawn from: softmax of the logits after temperature, then top-k, then
top-p (renormalized over the kept tokens), like vLLM's ``logprobs_mode="processed_logprobs"``.
Greedy decoding (temperature 0) reports log_softmax of the raw logits. A row's stop token counts
as a completion token (mask 1, its log-prob kept) and is left out of its text.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from qerl_kit.config_types import (NEW_TOKENS_RULE, TOP_K_RULE, TOP_P_RULE, check_rule, check_seed,
                                   check_temperature, short_repr)

__all__ = ["SamplingParams", "Prompts", "Generation", "Rollouts", "as_prompts"]


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 = off
    seed: int | None = None    # seeds the sampling RNG for reproducibility

    def __post_init__(self):
        # Errors read "<field> must be <allowed>; got <repr(value)>", as configs' do. Bools are not
        # numbers here; numpy scalars are.
        # Types are checked here (strictly: no strings, no bools), ranges by the rules the config shares
        if not _is_int(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an int >= 1; got {short_repr(self.max_new_tokens)}")
        check_rule("max_new_tokens", self.max_new_tokens, int, NEW_TOKENS_RULE)
        # 0 means greedy (evaluation); inf would flatten the logits to uniform and nan poisons them; the
        # range is the one every temperature obeys (config_types.check_temperature: >= 1e-4, so that
        # logits / T stay finite), with 0 allowed here for greedy decoding. Strings are not numbers here.
        if not _is_real(self.temperature):
            raise ValueError(f"temperature must be 0 (greedy) or a finite float >= 0.0001; got {short_repr(self.temperature)}")
        check_temperature("temperature", self.temperature, greedy=True)
        if not _is_real(self.top_p):
            raise ValueError(f"top_p must be a finite float in (0, 1]; got {short_repr(self.top_p)}")
        check_rule("top_p", self.top_p, float, TOP_P_RULE)  # nan and inf too
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an int >= 0; got {short_repr(self.top_k)}")
        check_rule("top_k", self.top_k, int, TOP_K_RULE)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None (None = the global RNG); got {short_repr(self.seed)}")
        if self.seed is not None:  # the engines hand it to a 64-bit generator as it is
            check_seed("seed", self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---- prompts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompts:
    """Prompts as token ids, with the texts they came from (``""`` where only ids were given)."""

    ids: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]

    def __post_init__(self):
        if len(self.ids) != len(self.texts):
            raise ValueError(f"Prompts has {len(self.ids)} id lists for {len(self.texts)} texts")
        if not self.ids:
            raise ValueError("prompts is empty: nothing to generate")
        empty = [i for i, p in enumerate(self.ids) if len(p) == 0]
        if empty:
            raise ValueError(f"prompts {empty[:5]} have zero tokens; nothing to condition on")

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: slice) -> "Prompts":
        if not isinstance(index, slice):
            raise TypeError("Prompts supports slicing (prompts[i:j]); use .ids[i] or .texts[i] for one prompt")
        return Prompts(self.ids[index], self.texts[index])

    @classmethod
    def encode(cls, tokenizer: Any, texts: Sequence[str], add_special_tokens: bool = False) -> "Prompts":
        """Tokenize prompt texts (the one place prompts are tokenized), without padding."""
        texts = _check_texts(texts)
        if tokenizer is None:
            raise ValueError("prompt texts need a tokenizer to become token ids; pass one, or pass token ids")
        ids = tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        return cls(tuple(tuple(int(t) for t in row) for row in ids), tuple(texts))

    @classmethod
    def from_ids(cls, ids: Sequence[Sequence[int]], texts: Sequence[str] | None = None) -> "Prompts":
        ids = tuple(tuple(int(t) for t in row) for row in ids)
        return cls(ids, tuple(texts) if texts is not None else ("",) * len(ids))


def _check_texts(prompts: Any) -> list[str]:
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not one string; wrap it: [prompt]")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: nothing to generate")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("every prompt must be a string (render chat messages with "
                        "qerl_kit.data.build_prompt or tokenizer.apply_chat_template first)")
    return prompts


def as_prompts(prompts: Any, tokenizer: Any = None, add_special_tokens: bool = False) -> Prompts:
    """``Prompts`` from what a caller passes an engine: ``Prompts`` (kept as they are), a list of
    texts (tokenized by ``Prompts.encode``) or a list of token-id lists."""
    if isinstance(prompts, Prompts):
        return prompts
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not one string; wrap it: [prompt]")
    prompts = list(prompts)
    if prompts and all(isinstance(p, str) for p in prompts):
        return Prompts.encode(tokenizer, prompts, add_special_tokens)
    if prompts and all(isinstance(p, (list, tuple, Tensor)) for p in prompts):
        rows = [p.tolist() if isinstance(p, Tensor) else p for p in prompts]
        if all(all(_is_int(t) for t in row) for row in rows):
            return Prompts.from_ids(rows)
    return Prompts.encode(tokenizer, _check_texts(prompts), add_special_tokens)  # raises the clear error


def check_n(n: Any) -> int:
    if not _is_int(n) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1; got {short_repr(n)}")
    return int(n)


# ---- padding -------------------------------------------------------------------------------------
def pad_rows(rows: Sequence[Tensor], pad: float | int, left: bool, dtype=None) -> Tensor:
    """Stack 1-D tensors of different lengths into [len(rows), max_len], padded left or right."""
    width = max((len(r) for r in rows), default=0)
    ref = rows[0] if len(rows) else torch.zeros(0, dtype=torch.long)
    out = torch.full((len(rows), width), pad, dtype=dtype or ref.dtype, device=ref.device)
    for i, r in enumerate(rows):
        if len(r):
            if left:
                out[i, width - len(r):] = r
            else:
                out[i, :len(r)] = r
    return out


def repad(x: Tensor, width: int, pad: float | int, left: bool) -> Tensor:
    """Widen [rows, w] to [rows, width] with ``pad`` on the left or right."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    fill = x.new_full((x.shape[0], extra), pad)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


# (field, padding value, padded on the left) for the tensors Generation and Rollouts share
_PADDED = (("prompt_ids", None, True), ("prompt_mask", 0, True), ("completion_ids", None, False),
           ("completion_mask", 0, False), ("logprobs", 0.0, False))


def _check_padded(obj: Any, kind: str, rows: set[int]) -> None:
    """The padded tensors of a Generation/Rollouts agree in shape, and every field in ``rows``."""
    if obj.prompt_mask.shape != obj.prompt_ids.shape:
        raise ValueError(f"prompt_mask {tuple(obj.prompt_mask.shape)} != prompt_ids {tuple(obj.prompt_ids.shape)}")
    for name in ("completion_mask", "logprobs"):
        if getattr(obj, name).shape != obj.completion_ids.shape:
            raise ValueError(f"{name} {tuple(getattr(obj, name).shape)} != completion_ids "
                             f"{tuple(obj.completion_ids.shape)}")
    rows = rows | {obj.prompt_ids.shape[0], obj.completion_ids.shape[0]}
    if len(rows) != 1:
        raise ValueError(f"{kind} fields disagree on the number of rows: {sorted(rows)}")


def _concat_padded(parts: Sequence[Any], pad: int) -> dict[str, Tensor]:
    """The shared tensors of several Generation/Rollouts, re-padded to common widths and stacked."""
    P = max(p.prompt_ids.shape[1] for p in parts)
    C = max(p.completion_ids.shape[1] for p in parts)
    return {name: torch.cat([repad(getattr(p, name), P if left else C, pad if value is None else value, left)
                             for p in parts]) for name, value, left in _PADDED}


def _sum_stats(parts: Sequence[Any]) -> dict[str, float]:
    """Timings and token counts summed over parts (keys every part has); throughput recomputed."""
    keys = [k for k in parts[0].stats if k != "rollout/tokens_per_s" and all(k in p.stats for p in parts)]
    stats = {k: sum(p.stats[k] for p in parts) for k in keys}
    if stats.get("rollout/seconds") and "rollout/tokens" in stats:
        stats["rollout/tokens_per_s"] = stats["rollout/tokens"] / stats["rollout/seconds"]
    return stats


# ---- token-level output --------------------------------------------------------------------------
@dataclass
class Generation:
    prompt_ids: Tensor       # [R, P] left-padded with pad_token_id
    prompt_mask: Tensor      # [R, P] 1 on real prompt tokens
    completion_ids: Tensor   # [R, C] right-padded with pad_token_id
    completion_mask: Tensor  # [R, C] 1 on real completion tokens, stop token included
    logprobs: Tensor         # [R, C] float32 sampling log-probs, 0 on padding
    stopped: Tensor          # [R] bool: the row ended with a stop token (else it hit the length limit)
    stats: dict[str, float] = field(default_factory=dict)  # backend timings (rollout/prefill_seconds ...)

    def __post_init__(self):
        _check_padded(self, "Generation", {self.stopped.shape[0]})

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def head(self, rows: int) -> "Generation":
        """The first ``rows`` rows (drops the padding rows of a last batch)."""
        return dataclasses.replace(self, **{n: getattr(self, n)[:rows] for n, _, _ in _PADDED},
                                   stopped=self.stopped[:rows], stats=dict(self.stats))

    @classmethod
    def concat(cls, parts: Sequence["Generation"], pad_token_id: int) -> "Generation":
        if not parts:
            raise ValueError("Generation.concat needs at least one Generation")
        if len(parts) == 1:
            return parts[0]
        return cls(**_concat_padded(parts, pad_token_id), stopped=torch.cat([p.stopped for p in parts]),
                   stats=_sum_stats(parts))

    @classmethod
    def from_lists(cls, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]],
                   logprobs: Sequence[Sequence[float]], stopped: Sequence[bool], pad_token_id: int,
                   stats: dict | None = None) -> "Generation":
        """From per-row lists (what vLLM returns); completion ids include the stop token."""
        long = lambda rows: [torch.tensor(list(r), dtype=torch.long) for r in rows]  # noqa: E731
        p_ids, c_ids = long(prompt_token_ids), long(completion_token_ids)
        return cls(pad_rows(p_ids, pad_token_id, left=True), pad_rows([torch.ones_like(r) for r in p_ids], 0, left=True),
                   pad_rows(c_ids, pad_token_id, left=False),
                   pad_rows([torch.ones_like(r) for r in c_ids], 0, left=False),
                   pad_rows([torch.tensor(list(r), dtype=torch.float32) for r in logprobs], 0.0, left=False,
                            dtype=torch.float32),
                   torch.tensor([bool(s) for s in stopped], dtype=torch.bool), dict(stats or {}))


# ---- rollouts ------------------------------------------------------------------------------------
@dataclass
class Rollouts:
    prompts: list[str]            # len B*n, each prompt repeated n times, group-contiguous
    prompt_ids: Tensor            # [B*n, P] left-padded with pad_token_id
    prompt_mask: Tensor           # [B*n, P] 1 on real prompt tokens
    completion_ids: Tensor        # [B*n, C] right-padded with pad_token_id
    completion_mask: Tensor       # [B*n, C] 1 on real completion tokens, stop token included
    logprobs: Tensor              # [B*n, C] float32 sampling log-probs, 0 on padding
    texts: list[str]              # decoded completions (special tokens and stop token skipped)
    finish_reasons: list[str]     # "stop" (EOS / stop token) or "length"
    group_size: int
    pad_token_id: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        _check_padded(self, "Rollouts", {len(self.prompts), len(self.texts), len(self.finish_reasons)})
        rows = self.prompt_ids.shape[0]
        if self.group_size < 1 or rows % self.group_size:
            raise ValueError(f"{rows} rows do not split into groups of {self.group_size}")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_ids(self) -> Tensor:           # [B*n, P+C] prompt then completion
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:      # [B*n, P+C]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> Tensor:  # [B*n] number of completion tokens, stop token included
        return self.completion_mask.sum(dim=1)

    def completion_id_lists(self) -> list[list[int]]:
        """Each row's completion ids (stop token included, padding dropped): reward functions' ``completion_ids``."""
        return [c[m.bool()].tolist() for c, m in zip(self.completion_ids, self.completion_mask)]

    def to(self, device: torch.device | str) -> "Rollouts":
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **moved, stats=dict(self.stats))

    def __repr__(self) -> str:
        lengths = self.completion_lengths.float()
        stop = sum(r == "stop" for r in self.finish_reasons) / max(len(self), 1)
        return (f"Rollouts({len(self) // self.group_size} prompts x {self.group_size}, prompt len "
                f"{self.prompt_ids.shape[1]}, completion len mean {lengths.mean().item():.1f} max "
                f"{self.completion_ids.shape[1]}, {stop:.0%} stopped, {int(lengths.sum())} tokens)")

    @classmethod
    def from_generation(cls, prompts: Prompts, gen: Generation, n: int, texts: Sequence[str],
                        pad_token_id: int, stats: dict | None = None) -> "Rollouts":
        """A Generation of ``prompts`` x ``n`` with its decoded ``texts``; ``stats`` are added to its own."""
        if len(gen) != len(prompts) * n:
            raise ValueError(f"a generation of {len(gen)} rows for {len(prompts)} prompts x {n} samples")
        return cls([p for p in prompts.texts for _ in range(n)], gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                   gen.completion_mask, gen.logprobs, list(texts),
                   ["stop" if s else "length" for s in gen.stopped.tolist()], n, pad_token_id,
                   {**gen.stats, **(stats or {})})

    @classmethod
    def from_lists(cls, prompts: Sequence[str], prompt_token_ids: Sequence[Sequence[int]],
                   completion_token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                   texts: Sequence[str], finish_reasons: Sequence[str], group_size: int,
                   pad_token_id: int, stats: dict | None = None) -> "Rollouts":
        """Build from per-row lists; completion ids include the stop token."""
        gen = Generation.from_lists(prompt_token_ids, completion_token_ids, logprobs,
                                    [r == "stop" for r in finish_reasons], pad_token_id, stats)
        return cls(list(prompts), gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask,
                   gen.logprobs, list(texts), list(finish_reasons), group_size, pad_token_id, dict(gen.stats))

    def select(self, rows: Sequence[int] | Tensor) -> "Rollouts":
        """These rows (whole groups, e.g. the groups DAPO keeps), with all-padding columns trimmed."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_ids.device).flatten()
        if len(idx) % self.group_size:
            raise ValueError(f"selected {len(idx)} rows: not whole groups of {self.group_size}")
        pm, cm = self.prompt_mask[idx], self.completion_mask[idx]
        P = self.prompt_ids.shape[1] - (int(pm.sum(1).max()) if len(idx) else 0)  # first kept column
        C = int(cm.sum(1).max()) if len(idx) else 0
        rows_l = idx.tolist()
        return Rollouts([self.prompts[i] for i in rows_l], self.prompt_ids[idx, P:], pm[:, P:],
                        self.completion_ids[idx, :C], cm[:, :C], self.logprobs[idx, :C],
                        [self.texts[i] for i in rows_l], [self.finish_reasons[i] for i in rows_l],
                        self.group_size, self.pad_token_id, dict(self.stats))

    @classmethod
    def concat(cls, parts: Sequence["Rollouts"]) -> "Rollouts":
        """Concatenate rollouts (micro-batches, DAPO refills) of one group size, re-padding."""
        if not parts:
            raise ValueError("Rollouts.concat needs at least one Rollouts")
        if len({p.group_size for p in parts}) != 1:
            raise ValueError(f"cannot concatenate group sizes {sorted({p.group_size for p in parts})}")
        pad = parts[0].pad_token_id
        return cls([s for p in parts for s in p.prompts], **_concat_padded(parts, pad),
                   texts=[t for p in parts for t in p.texts],
                   finish_reasons=[r for p in parts for r in p.finish_reasons],
                   group_size=parts[0].group_size, pad_token_id=pad, stats=_sum_stats(parts))
