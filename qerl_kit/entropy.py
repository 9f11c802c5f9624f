"""Policy entropy over completion tokens: how much the policy explores.

``policy_entropy(model, input_ids, completion_mask)`` is the mean, over completion tokens, of the
entropy ``H = -sum_v p(v) log p(v)`` of the next-token distribution that produced each token
(the logits one position earlier), which is the metric TRL logs as ``entropy``. The QeRL paper's
claim is that quantization noise (and AQN) raise it early in training.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Per-position entropy [...,] of softmax(logits) [..., V], in float32, chunked over rows."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk):
        rows = flat[start:start + chunk].float()
        logp = torch.log_softmax(rows, dim=-1)
        out[start:start + chunk] = -(logp.exp() * logp).sum(-1)
    return out.reshape(logits.shape[:-1])


@torch.no_grad()
def policy_entropy(model: torch.nn.Module, input_ids: torch.Tensor, completion_mask: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Mean next-token entropy over completion tokens (a 0-dim float32 tensor).

    ``input_ids`` [B, T] hold prompt + completion; ``completion_mask`` [B, T] is 1 on completion
    tokens. The distribution that sampled token t is the one at position t-1, so the entropy at
    t-1 is averaged wherever ``completion_mask[:, t]`` is 1. ``temperature`` divides the logits,
    matching the sampling distribution.
    """
    if input_ids.shape != completion_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and completion_mask "
                         f"{tuple(completion_mask.shape)} must have the same shape")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive; got {temperature}")
    position_ids = None
    if attention_mask is not None:  # left padding must not shift positions (as in generate)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
    ent = entropy_from_logits(logits / temperature)  # [B, T-1]
    mask = completion_mask[:, 1:].to(ent.dtype)
    if mask.sum() == 0:
        raise ValueError("completion_mask selects no completion tokens")
    return (ent * mask).sum() / mask.sum()
