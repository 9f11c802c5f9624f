"""Rollouts: sample n completions per prompt, with the log-probs of the distribution sampled from.

One contract, several backends (docs/rollout.md, docs/architecture.md):

* the data (``qerl_kit.rollout.types``): ``SamplingParams``, ``Prompts`` (token ids + texts,
  tokenized once by ``Prompts.encode``), ``Generation`` (token-level output) and ``Rollouts``
  (plus texts and finish reasons, group-contiguous);
* the interface (``qerl_kit.rollout.base``): ``engine.sync(policy, noise=aqn, step=step)`` before
  a rollout, then ``engine.generate(prompts, n, sampling)``;
* the backends: ``HFEngine`` (transformers' generate, any model, CPU or GPU), ``StaticEngine``
  (ours: static KV cache, CUDA graphs), ``VLLMEngine`` (vLLM on the exported NVFP4 base), made by
  name with ``make_engine`` (``qerl_kit.rollout.registry``).

The backends are imported when first used: ``from qerl_kit.rollout import StaticEngine`` loads
only what that engine needs.
"""

from __future__ import annotations

from qerl_kit.rollout.base import Engine, ModelEngine, RolloutEngine
from qerl_kit.rollout.registry import ENGINES, engine_names, make_engine, register_engine
from qerl_kit.rollout.types import Generation, Prompts, Rollouts, SamplingParams, as_prompts

__all__ = ["SamplingParams", "Prompts", "Generation", "Rollouts", "as_prompts", "RolloutEngine", "Engine",
           "ModelEngine", "HFEngine", "StaticEngine", "VLLMEngine", "make_engine", "register_engine", "ENGINES",
           "engine_names"]

_LAZY = {"HFEngine": "qerl_kit.rollout.hf", "StaticEngine": "qerl_kit.rollout.static",
         "VLLMEngine": "qerl_kit.rollout.vllm"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qerl_kit.rollout' has no attribute {name!r}")
