"""Training-side log-probabilities of completion tokens (and their entropy), micro-batched.

The rollout engine returns prompt ids left-padded and completion ids right-padded; the model sees
each row's prompt and completion moved to its first column, the padding after them, causal with no
attention mask (``completion_logprobs``): every real token at the position ``generate`` gave it, so
training log-probs match sampling ones, and SDPA can take its flash kernel (there is no mask).
Logits are divided by the sampling temperature, so the ratio in the loss compares like with like.

Memory: the model's logits [B, C, V] (completion positions only) stay in its dtype; the float32
log-softmax (and entropy) is taken over chunks of completion positions of about ``CHUNK_ELEMS``
values, each chunk under activation checkpointing when gradients are on. So the float32 copies of
the full-vocabulary logits, the largest tensors of a long-completion training step (about 40 GB at
8 x 4096 tokens over Qwen2.5's 152k vocabulary), never exist; backward recomputes one chunk at a
time. The entropy (never with gradient) is taken from the same log-softmax where one is computed whole
(no gradient, or a single chunk kept for backward), else from its own per chunk: at most two
float32 chunks at once, so a training forward can return both (``loss.old_logp: fold``).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

from qerl_kit.config_types import MICRO_BATCH_ORDERS

CHUNK_ELEMS = 1 << 28  # float32 logits per chunk (1 GiB)


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def _chunk_logp(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    return _log_softmax(logits, temperature).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the vocabulary of a float32 log-softmax chunk, in place: one more chunk at most."""
    return -logp.detach().exp().mul_(logp.detach()).sum(-1)


def _chunk_logp_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """An unchunked or no-grad chunk's log-probs and entropy from one log-softmax (kept for backward
    anyway when gradients are on, so the entropy costs one transient chunk, no second log-softmax)."""
    full = _log_softmax(logits, temperature)
    return full.gather(-1, ids.unsqueeze(-1)).squeeze(-1), _entropy(full)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, chunk: int | None = None):
    """log softmax(logits / T)[ids] for logits [B, C, V] (any dtype) -> [B, C] float32, computed
    ``chunk`` positions at a time (default: CHUNK_ELEMS float32 values per chunk); optionally the
    entropy [B, C] too, always without gradient (from the detached logits, so one training forward
    gives log-probs with gradient and the entropy: the Trainer's folded old-policy pass)."""
    B, C, V = logits.shape
    chunk = chunk or max(1, CHUNK_ELEMS // max(B * V, 1))
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts, ents = [], []
    for s in range(0, C, chunk):
        part, part_ids = logits[:, s:s + chunk], ids[:, s:s + chunk]
        if grad and chunk < C:  # keep only the model-dtype logits for backward, recompute the rest
            parts.append(checkpoint(_chunk_logp, part, part_ids, temperature, use_reentrant=False))
            if with_entropy:  # the checkpointed log-softmax is gone: its own (at most two chunks at once)
                ents.append(_entropy(_log_softmax(part.detach(), temperature)))
        elif with_entropy:
            logp, ent = _chunk_logp_entropy(part, part_ids, temperature)
            parts.append(logp)
            ents.append(ent)
        else:
            parts.append(_chunk_logp(part, part_ids, temperature))
    logp = torch.cat(parts, dim=1) if parts else logits.new_zeros((B, 0), dtype=torch.float32)
    if not with_entropy:
        return logp
    return logp, (torch.cat(ents, dim=1) if ents else torch.zeros_like(logp))


def padding_bounds(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[int, int]:
    """(first prompt column, end of the completion columns) that hold a real token of some row: the
    columns before the first and from the end on are padding in every row (left-padded prompts,
    right-padded completions). One host sync. A row-less or all-padding batch keeps one column of
    each (the model needs a position to predict from)."""
    return _bounds(*_row_spans(prompt_mask, completion_mask), prompt_mask.shape[1], completion_mask.shape[1])


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that turns a causal LM's hidden states into logits (``get_output_embeddings``; through a
    DistributedDataParallel wrapper and peft's), or None."""
    inner = getattr(model, "module", model)  # DDP keeps the model as .module
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


@contextlib.contextmanager
def head_rows(head: torch.nn.Module, cols: torch.Tensor):
    """Inside the block ``head`` (``output_head``) computes row b's logits at columns ``cols[b]`` only
    (cols [B, c]): a forward pre-hook gathers the hidden states [B, T, H] it is given to [B, c, H]. The
    model's logits are then [B, c, V]; the gather's backward is over the hidden size, not the vocabulary."""
    def pick(_module, args):
        hidden = args[0]
        return (hidden.gather(1, cols[:, :, None].expand(-1, -1, hidden.shape[-1])), *args[1:])

    handle = head.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def _aligned_logits(model, head: torch.nn.Module, input_ids: torch.Tensor, real: torch.Tensor, p: int):
    """The logits [B, c, V] that predict the completion tokens (columns p on of ``input_ids``), from each
    row's real tokens moved to column 0 in their order (a stable sort of ``real``; any padding, left,
    right or holes, goes after them), the model causal with no mask, the head on those positions only."""
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices
    cols = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(order)
    where = torch.empty_like(order).scatter_(1, order, cols)  # each old column's new one; no host read
    # the logits that predict completion token j: the column before it (the previous real token's). No
    # position ids: the model's own 0, 1, ... are these rows' (given ones with no mask would have
    # transformers look for packed sequences in them, a read back per forward)
    with head_rows(head, (where[:, p:] - 1).clamp(min=0)):
        logits = model(input_ids=input_ids.gather(1, order), use_cache=False).logits
    if logits.shape[:2] != (input_ids.shape[0], input_ids.shape[1] - p):
        raise RuntimeError(f"{type(model).__name__}'s logits have shape {tuple(logits.shape)}, not one row "
                           f"per completion token {(input_ids.shape[0], input_ids.shape[1] - p)}: its "
                           "get_output_embeddings() is not what makes its logits; pass aligned=False")
    return logits


def completion_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                        temperature: float = 1.0, with_entropy: bool = False, trim: bool = True,
                        bounds: tuple[int, int] | None = None, aligned: bool = True):
    """Log-probs [B, C] (float32) of ``completion_ids`` under ``model``, with gradient when autograd is on;
    optionally the entropy [B, C] too, without gradient.

    ``trim``: the model runs on these rows' own width, not the batch's: the leading prompt columns and
    the trailing completion columns that are padding in every row are cut off (``padding_bounds``), and
    the outputs padded back to [B, C] with zeros (positions no row's mask counts). Every real token sees
    what it saw untrimmed: the same log-probs up to the float rounding of a different matmul shape. A
    micro-batch of short completions in a batch with a long one costs its own length, not the longest's.
    ``bounds``: these rows' ``padding_bounds`` when the caller has them (``micro_batch_plan`` reads every
    micro-batch's at once), so the forward does not read back.

    ``aligned`` (default): each row's real tokens are moved to start at column 0, in order (its prompt's
    left padding goes after its completion) and the model runs causal with no attention mask: a real
    token attends only to earlier columns, all real tokens of its row, so it sees what the padded layout
    shows it, at the positions it had there (the mask's count: 0, 1, ...). The output head computes the
    completion positions only (``head_rows``). ``aligned=False`` (or a model without ``get_output_embeddings``):
    the engine's layout, left-padded prompt + right-padded completion under an attention mask. Why the
    default: with a mask PyTorch 2.11's SDPA picks cuDNN attention on an H100, whose backward gave NaN
    gradients from finite log-probs on one micro-batch of the real Qwen2.5-0.5B's GSM8K rollouts (the
    math and memory-efficient kernels did not: bench/results/step_h200.md, hold 10); without a mask
    it runs causal flash attention."""
    C = completion_ids.shape[1]
    if trim:
        first, end = padding_bounds(prompt_mask, completion_mask) if bounds is None else bounds
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
        completion_ids, completion_mask = completion_ids[:, :end], completion_mask[:, :end]
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    real = torch.cat([prompt_mask, completion_mask], dim=1)
    head = output_head(model) if aligned else None
    if head is not None:
        logits = _aligned_logits(model, head, input_ids, real.bool(), p)
    else:
        attention = real.long()
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False)
        logits = out.logits[:, p - 1:p + c - 1]
    res = token_logprobs(logits, completion_ids, temperature, with_entropy)
    logp, ent = res if with_entropy else (res, None)
    logp = logp * completion_mask.to(logp.dtype)
    if c < C:  # back to the batch's width: zeros where every row of this micro-batch is padding
        logp = torch.nn.functional.pad(logp, (0, C - c))
        ent = None if ent is None else torch.nn.functional.pad(ent, (0, C - c))
    return (logp, ent) if with_entropy else logp


def micro_batch_plan(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, size: int,
                     order: str = "length") -> tuple[list, list[tuple[int, int]]]:
    """The rows of each micro-batch of a batch: ``size`` rows at a time in the batch's order
    (``"batch"``: slices); ``"length"``: the rows sorted by completion length, then prompt length (a
    stable sort, one host sync), cut into micro-batches of ``size`` neighbours in that order (each a
    LongTensor of row indices, ascending; slices again where the sort keeps the batch's order, fixed
    lengths say); ``"packed"``: sorted so, then each micro-batch takes as many neighbours as fit a
    token budget of ``size`` x the batch's width (what one padded micro-batch of ``size`` rows ran):
    rows x the group's trimmed width never exceeds it, so no forward is larger than before, and short
    rows share fewer, larger forwards (verl's dynamic batch size, bounded by the batch's own worst case).
    Each micro-batch runs on its own width (``completion_logprobs(trim=True)``), so rows of similar
    lengths together pass fewer padding tokens through the model; every row is in exactly one
    micro-batch, and the losses' per-row terms and global normalizers (``grpo.LossSpec``) do not depend
    on the grouping. Returns (the groups, each group's ``padding_bounds``), from one read back of the
    rows' lengths: the step's forwards then read nothing back for their widths."""
    if order not in MICRO_BATCH_ORDERS:
        raise ValueError(f"loss.micro_batch_order must be one of {MICRO_BATCH_ORDERS}; got {order!r}")
    n, p, c = completion_mask.shape[0], prompt_mask.shape[1], completion_mask.shape[1]
    spans, ends = _row_spans(prompt_mask, completion_mask)
    groups = _groups(spans, ends, n, size, order, p, c)
    return [g if isinstance(g, slice) else g.to(completion_mask.device) for g in groups], \
        [_bounds(spans[g], ends[g], p, c) for g in groups]


def micro_batches(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, size: int,
                  order: str = "length") -> list:
    """The row selections of ``micro_batch_plan`` (without their bounds)."""
    return micro_batch_plan(prompt_mask, completion_mask, size, order)[0]


def _groups(spans: torch.Tensor, ends: torch.Tensor, n: int, size: int, order: str, p: int, c: int) -> list:
    if order == "batch" or n <= size:
        return _in_order(n, size)
    rows = torch.sort(ends * (p + 1) + spans, stable=True).indices
    cuts = _packed_cuts(rows.tolist(), spans.tolist(), ends.tolist(), size * (p + c)) if order == "packed" \
        else list(range(0, n, size)) + [n]
    if torch.equal(rows, torch.arange(n)) and cuts == list(range(0, n, size)) + [n]:
        return _in_order(n, size)
    return [rows[a:b].sort().values for a, b in zip(cuts, cuts[1:])]


def _bounds(spans: torch.Tensor, ends: torch.Tensor, p: int, c: int) -> tuple[int, int]:
    """``padding_bounds`` of the rows with these spans and ends (host tensors, ``_row_spans``), no read back:
    the first real column of any row is p - the largest span, the last one the largest end. At least
    one prompt column (it predicts the first completion token) and one completion column where c > 0."""
    span, end = (int(spans.max()), int(ends.max())) if spans.numel() else (0, 0)
    return (p - span if span else max(0, p - 1)), (end if end else min(1, c))


def _row_spans(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, on the host (one read back): the prompt columns from its first real one to the end (0 for
    none) and one past its last real completion column (0 for none): the columns ``padding_bounds``
    keeps for a micro-batch are the largest of each over its rows."""
    p, c = prompt_mask.shape[1], completion_mask.shape[1]
    n = completion_mask.shape[0]
    if p:
        real = prompt_mask.bool()
        spans = torch.where(real.any(1), p - real.int().argmax(1), 0)
    else:
        spans = torch.zeros(n, dtype=torch.long, device=prompt_mask.device)
    positions = torch.arange(1, c + 1, device=completion_mask.device)
    ends = (completion_mask.bool() * positions).amax(1) if c else torch.zeros(n, dtype=torch.long,
                                                                           device=completion_mask.device)
    both = torch.stack([spans.long().to(ends.device), ends.long()]).cpu()
    return both[0], both[1]


def _packed_cuts(rows: list[int], spans: list[int], ends: list[int], budget: int) -> list[int]:
    """Where ``rows`` (in order) are cut so that each piece's rows x width stays within ``budget`` tokens;
    the width as ``padding_bounds`` keeps it (at least one prompt and one completion column)."""
    cuts, span, end, count = [0], 0, 0, 0
    for i, r in enumerate(rows):
        s, e = max(span, spans[r], 1), max(end, ends[r], 1)
        if count and (count + 1) * (s + e) > budget:
            cuts.append(i)
            s, e, count = max(spans[r], 1), max(ends[r], 1), 0
        span, end, count = s, e, count + 1
    return cuts + [len(rows)]


def _in_order(n: int, size: int) -> list[slice]:
    return [slice(s, s + size) for s in range(0, n, size)]


def micro_batch_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, groups,
                       bounds: list[tuple[int, int]] | None = None) -> list[int]:
    """The tokens each of these micro-batches (``micro_batches``' row selections) runs through the
    model: its rows x its width once trimmed (``padding_bounds``; ``bounds``: ``micro_batch_plan``'s,
    else read back once for all of them)."""
    n, p, c = prompt_mask.shape[0], prompt_mask.shape[1], completion_mask.shape[1]
    if bounds is None:
        spans, ends = _row_spans(prompt_mask, completion_mask)
        bounds = [_bounds(spans[_host(g)], ends[_host(g)], p, c) for g in groups]
    rows = [len(range(n)[g]) if isinstance(g, slice) else int(g.numel()) for g in groups]
    return [r * (p - first + end) for r, (first, end) in zip(rows, bounds)]


def _host(group):
    return group if isinstance(group, slice) else group.cpu()


def widest_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, groups,
                  bounds: list[tuple[int, int]] | None = None) -> int:
    """The most tokens one of these micro-batches runs through the model (``micro_batch_tokens``); at least 1."""
    return max([1, *micro_batch_tokens(prompt_mask, completion_mask, groups, bounds)])


def row_groups(micro_batch, n: int) -> list:
    """Row selections: ``micro_batch`` rows at a time in order (an int), or the given ones (``micro_batches``)."""
    return _in_order(n, micro_batch) if isinstance(micro_batch, int) else list(micro_batch)


@torch.no_grad()
def batched_logprobs(model, rollouts, temperature: float, micro_batch, with_entropy: bool = False,
                     bounds: list[tuple[int, int]] | None = None):
    """``completion_logprobs`` over a whole rollout batch in micro-batches, without gradients;
    ``micro_batch``: rows per micro-batch (in the batch's order), or the row selections of
    ``micro_batches`` (``bounds``: ``micro_batch_plan``'s, one per selection). The outputs are in the
    batch's row order."""
    n, C = rollouts.completion_ids.shape
    logp = torch.zeros((n, C), dtype=torch.float32, device=rollouts.completion_ids.device)
    ent = torch.zeros_like(logp) if with_entropy else None
    groups = row_groups(micro_batch, n)
    for sl, bound in zip(groups, bounds or [None] * len(groups), strict=True):
        res = completion_logprobs(model, rollouts.prompt_ids[sl], rollouts.prompt_mask[sl],
                                  rollouts.completion_ids[sl], rollouts.completion_mask[sl],
                                  temperature, with_entropy, bounds=bound)
        if with_entropy:
            logp[sl], ent[sl] = res
        else:
            logp[sl] = res
    return (logp, ent) if with_entropy else logp
