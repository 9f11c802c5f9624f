"""Training-side log-probabilities of completion tokens (and their entropy), micro-batched.

The rollout engine returns prompt ids left-padded and completion ids right-padded; the model
sees their concatenation. Position ids are derived from the attention mask (as ``generate``
does), so left padding does not shift positions and training log-probs match sampling ones.
Logits are divided by the sampling temperature, so the ratio in the loss compares like with like.

Memory: the model's logits [B, P+C, V] stay in its dtype; the float32 log-softmax (and entropy)
is taken over chunks of completion positions of about ``CHUNK_ELEMS`` values, each chunk under
activation checkpointing when gradients are on. So the float32 copies of the full-vocabulary
logits, the largest tensors of a long-completion training step (about 40 GB at 8 x 4096 tokens
over Qwen2.5's 152k vocabulary), never exist; backward recomputes one chunk at a time.
The entropy (never with gradient) is taken from the same log-softmax where one is computed whole
(no gradient, or a single chunk kept for backward), else from its own per chunk: at most two
float32 chunks at once, so a training forward can return both (``loss.old_logp: fold``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

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


def completion_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                        temperature: float = 1.0, with_entropy: bool = False):
    """Log-probs [B, C] (float32) of ``completion_ids`` under ``model``, with gradient when autograd is on;
    optionally the entropy [B, C] too, without gradient."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1).long()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False)
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    logits = out.logits[:, p - 1:p + c - 1]  # [B, C, V], the model's dtype
    res = token_logprobs(logits, completion_ids, temperature, with_entropy)
    logp, ent = res if with_entropy else (res, None)
    logp = logp * completion_mask.to(logp.dtype)
    return (logp, ent) if with_entropy else logp


@torch.no_grad()
def batched_logprobs(model, rollouts, temperature: float, micro_batch: int, with_entropy: bool = False):
    """``completion_logprobs`` over a whole rollout batch in chunks, without gradients."""
    chunks, ents = [], []
    for start in range(0, rollouts.completion_ids.shape[0], micro_batch):
        sl = slice(start, start + micro_batch)
        res = completion_logprobs(model, rollouts.prompt_ids[sl], rollouts.prompt_mask[sl],
                                  rollouts.completion_ids[sl], rollouts.completion_mask[sl],
                                  temperature, with_entropy)
        if with_entropy:
            chunks.append(res[0])
            ents.append(res[1])
        else:
            chunks.append(res)
    logp = torch.cat(chunks)
    return (logp, torch.cat(ents)) if with_entropy else logp
