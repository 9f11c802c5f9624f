"""Rollout backends by name: ``make_engine(name, policy, tokenizer)`` and the registry it reads.

``ENGINES`` maps a name to a factory ``(policy, tokenizer, **kwargs) -> engine``; ``rollout.engine``
in a config may be any registered name or ``auto``, and config validation reads the names from
here. A new backend is one ``register_engine("mine", factory)`` call (docs/architecture.md).

``auto`` picks the StaticEngine when the policy is on a GPU and its layout is one the engine
knows (``qerl_kit.rollout.static.decoder.unsupported_layout``), transformers' generate otherwise (on the
CPU generate is as fast for small models). A layout the static engine does not cover is known
before building it; an error while building it is a bug and surfaces.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["ENGINES", "register_engine", "make_engine", "engine_names", "resolve_engine", "engine_options"]


def _hf(policy, tokenizer, **kwargs):
    from qerl_kit.rollout.hf import HFEngine

    return HFEngine(policy, tokenizer, **kwargs)


def _static(policy, tokenizer, **kwargs):
    from qerl_kit.rollout.static import StaticEngine

    return StaticEngine(policy, tokenizer, **kwargs)


def _vllm(policy, tokenizer, **kwargs):
    from qerl_kit.rollout.vllm import VLLMEngine

    return VLLMEngine.from_policy(policy, tokenizer, **kwargs)


ENGINES: dict[str, Callable[..., Any]] = {"hf": _hf, "static": _static, "vllm": _vllm}


def register_engine(name: str, factory: Callable[..., Any]) -> None:
    """Make ``name`` a rollout backend: ``factory(policy, tokenizer, **kwargs)`` returns the engine."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"an engine name must be a non-empty string other than 'auto'; got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of engine {name!r} must be callable; got {type(factory).__name__}")
    ENGINES[name] = factory


def engine_names() -> tuple[str, ...]:
    """The values ``rollout.engine`` accepts: ``auto`` and every registered backend."""
    return ("auto", *ENGINES)


def resolve_engine(name: str, policy) -> str:
    """The backend ``name`` stands for with this policy (``auto`` resolved, see the module docstring)."""
    if name != "auto":
        if name not in ENGINES:
            raise ValueError(f"unknown rollout engine {name!r}: use one of {', '.join(engine_names())}")
        return name
    from qerl_kit.rollout.static.decoder import unsupported_layout

    on_gpu = any(p.is_cuda for p in policy.parameters())
    return "static" if on_gpu and unsupported_layout(policy) is None else "hf"


def make_engine(name: str, policy, tokenizer, **kwargs):
    """The rollout engine ``name`` (``auto``, ``hf``, ``static``, ``vllm`` or a registered one) on ``policy``."""
    return ENGINES[resolve_engine(name, policy)](policy, tokenizer, **kwargs)


def engine_options(rollout, policy, tokenizer, task, lora_r: int, sample: int = 2000) -> dict:
    """The keyword arguments the Trainer gives ``make_engine`` for ``rollout`` (a RolloutConfig).
    For vLLM: ``max_model_len`` = the longest prompt of the task (its first ``sample`` train and eval
    rows, as the task formats them) + ``max_new_tokens``, and ``gpu_memory_utilization`` =
    ``rollout.vllm_gpu_memory`` or the share the memory planner gives for that length and
    ``rollout.batch_size`` (``memory_plan.vllm_memory_share``). Nothing for the other engines."""
    if resolve_engine(rollout.engine, policy) != "vllm":
        return {}
    import torch

    rows = list(task.train[:sample]) + list(task.eval[:sample])
    longest = max(map(len, task.encode(tokenizer, rows).ids))  # rendered and tokenized as the rollouts will be
    max_len = -(-(longest + rollout.max_new_tokens) // 64) * 64
    share = rollout.vllm_gpu_memory
    if share is None:
        from qerl_kit.memory_plan import vllm_memory_share

        if not torch.cuda.is_available():  # VLLMEngine refuses to start without one, with its own message
            return {"max_model_len": max_len}
        config = getattr(policy, "config", None)
        share = vllm_memory_share(config, torch.cuda.get_device_properties(0).total_memory, lora_r=lora_r,
                                  rollout_batch=rollout.batch_size, max_model_len=max_len)
    return {"max_model_len": max_len, "gpu_memory_utilization": share}
