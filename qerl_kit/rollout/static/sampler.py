"""Sampling on the device, inside a CUDA graph: temperature, top-k, top-p, and the sampled token's
log-probability under the distribution it was drawn from.

Same semantics as ``qerl_kit.rollout`` (and vLLM's ``processed_logprobs``): logits / temperature,
then top-k, then top-p (transformers' rule: drop the tokens whose ascending cumulative probability
is <= 1 - top_p, always keeping the most likely one), log-softmax over what is kept. Greedy
(temperature 0) takes the argmax and reports the raw log-softmax. The draw is Gumbel-max with
``torch.rand`` from the default generator, which CUDA graphs replay with fresh philox offsets
(and the current seed) at every replay, so a captured step samples anew each time.
"""

from __future__ import annotations

import torch
from torch import Tensor


def process_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Log-probabilities [R, V] (float32) of the sampling distribution; -inf on removed tokens."""
    x = logits.float()
    if temperature == 0:
        return torch.log_softmax(x, dim=-1)
    if temperature != 1.0:
        x = x / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[:, -1] = False  # the most likely token always stays
        x = x.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> tuple[Tensor, Tensor]:
    """(tokens [R] long, their log-probs [R] float32) drawn from ``process_logits``."""
    logp = process_logits(logits, temperature, top_k, top_p)
    if temperature == 0:
        tokens = logp.argmax(dim=-1)
    else:
        u = torch.rand_like(logp).clamp_(min=1e-20, max=1.0 - 1e-7)
        tokens = (logp - torch.log(-torch.log(u))).argmax(dim=-1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
