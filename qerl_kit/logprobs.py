"""Training-side log-probabilities of completion tokens (and their entropy), micro-batched.

The rollout engine returns prompt ids left-padded and completion ids right-padded; the model
sees their concatenation. Position ids are derived from the attention mask (as ``generate``
does), so left padding does not shift positions and training log-probs match sampling ones.
Logits are divided by the sampling temperature, so the ratio in the loss compares like with like.
"""

from __future__ import annotations

import torch

from qerl_kit.entropy import entropy_from_logits


def completion_logprobs(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                        temperature: float = 1.0, with_entropy: bool = False):
    """Log-probs [B, C] (float32) of ``completion_ids`` under ``model``; optionally entropy [B, C]."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1).long()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids, use_cache=False)
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    logits = out.logits[:, p - 1:p + c - 1].float() / temperature  # [B, C, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    logp = logp * completion_mask.to(logp.dtype)
    if not with_entropy:
        return logp
    with torch.no_grad():
        ent = entropy_from_logits(logits.detach())
    return logp, ent


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
