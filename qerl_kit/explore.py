"""Exploration under AQN: how the policy's entropy and sample diversity move with the noise sigma.

``exploration_probe(model, tokenizer, prompts, aqn)`` returns ``probe(sigma) -> dict``, the
function ``qerl_kit.widgets.AQNPanel(probe=...)`` calls when its button is pressed (and that a
notebook calls in a loop for a static sweep). One call:

1. applies AQN noise of std ``sigma`` to the norms in front of the quantized projections
   (``with aqn.noise(model, step, sigma=sigma)``; sigma 0 is the clean policy);
2. samples ``n`` completions of every prompt with ``HFEngine`` (same seed at every sigma, so
   the only thing that changes between calls is the noise);
3. measures, still under the noise, the mean next-token entropy over the completion tokens: the
   trainer's ``entropy`` metric (``qerl_kit.logprobs.batched_logprobs``, which moves each row to
   column 0, so left padding does not shift positions), and the sample diversity:
   distinct completions per prompt divided by ``n``, averaged over prompts (1.0: all different);
4. restores the exact clean weights (the ``noise`` context manager does, even on an error).

With ``answers`` (one per prompt), the share of completions that ``gsm8k_reward`` scores as right
is reported too, so a sweep shows what exploration costs in accuracy. The AQN's own noise RNG is
re-seeded from ``seed`` at every call, so the probe is a pure function of sigma.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from qerl_kit.aqn import AQN
from qerl_kit.config_types import check_sigma
from qerl_kit.logprobs import batched_logprobs
from qerl_kit.rollout import HFEngine, SamplingParams

__all__ = ["exploration_probe", "sweep"]


def exploration_probe(model: torch.nn.Module, tokenizer, prompts: Sequence[str], aqn: AQN | None = None,
                      n: int = 8, max_new_tokens: int = 48, seed: int = 0, temperature: float = 1.0,
                      answers: Sequence[str] | None = None, step: int = 0,
                      engine=None) -> Callable[[float], dict]:
    """``probe(sigma) -> {"entropy", "distinct", "mean_length"[, "accuracy"]}`` for ``prompts``.

    ``prompts`` are rendered prompt texts (e.g. ``qerl_kit.data.build_prompt``); ``n`` samples each
    at ``temperature``. ``aqn`` supplies the norms and the noise RNG (a fresh ``AQN()`` by default;
    its schedule is not used: the probe always applies the sigma it is given).
    """
    prompts = list(prompts)
    if not prompts:
        raise ValueError("exploration_probe needs at least one prompt")
    if n < 2:
        raise ValueError(f"n must be >= 2 to measure diversity; got {n}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (the probe samples); got {temperature}")
    if answers is not None and len(answers) != len(prompts):
        raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts")
    aqn = aqn or AQN()
    engine = engine or HFEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    def probe(sigma: float) -> dict:
        sigma = check_sigma("sigma", sigma, zero=True)  # AQN's one sigma range, 0 = no noise
        aqn._generator.manual_seed(seed)  # the same noise draw for the same sigma
        with aqn.noise(model, step, sigma=sigma):
            out = engine.generate(prompts, n, sampling)
            _, ent = batched_logprobs(model, out, temperature, micro_batch=64, with_entropy=True)
        mask = out.completion_mask.float()
        groups = [out.texts[i * n:(i + 1) * n] for i in range(len(prompts))]
        result = {
            "entropy": float((ent * mask).sum() / mask.sum().clamp(min=1)),
            "distinct": sum(len(set(g)) for g in groups) / (n * len(groups)),
            "mean_length": float(out.completion_lengths.float().mean()),
        }
        if answers is not None:
            from qerl_kit.rewards import gsm8k_reward

            scores = gsm8k_reward(None, out.texts, answer=[a for a in answers for _ in range(n)])
            result["accuracy"] = sum(1.0 for s in scores if s is not None and s >= 1.0) / len(scores)
        return result

    return probe


def sweep(probe: Callable[[float], dict], sigmas: Sequence[float]) -> list[dict]:
    """``[{"sigma": s, **probe(s)} for s in sigmas]``: a static table for headless runs and plots."""
    return [{"sigma": float(s), **probe(s)} for s in sigmas]
