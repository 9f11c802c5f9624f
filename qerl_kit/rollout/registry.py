"""Rollout backends by name: ``make_engine(name, policy, tokenizer)`` and the registry it reads.

``ENGINES`` maps a name to a factory ``(policy, tokenizer, **kwargs) -> engine``; ``rollout.engine``
in a config may be any registered name or ``auto``, and config validation reads the names from
here. A new backend is one ``register_engine("mine", factory)`` call (docs/architecture.md).
What a backend takes from the run beyond the policy (vLLM: its context length and GPU memory
share, from ``rollout.vllm_gpu_memory`` or the memory planner) is its own module's business:
``ENGINE_OPTIONS`` maps its name to the function that reads it, and nothing backend-specific lives here.

``auto`` picks the StaticEngine when the policy is on a GPU and its layout is one the engine
knows (``qerl_kit.rollout.static.decoder.unsupported_layout``), transformers' generate otherwise (on the
CPU generate is as fast for small models). A layout the static engine does not cover is known
before building it; an error while building it is a bug and surfaces.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["ENGINES", "ENGINE_OPTIONS", "register_engine", "make_engine", "engine_names", "resolve_engine",
           "engine_options"]


def _hf(policy, tokenizer, **kwargs):
    from qerl_kit.rollout.hf import HFEngine

    return HFEngine(policy, tokenizer, **kwargs)


def _static(policy, tokenizer, **kwargs):
    from qerl_kit.rollout.static import StaticEngine

    return StaticEngine(policy, tokenizer, **kwargs)


def _vllm(policy, tokenizer, **kwargs):
    from qerl_kit.rollout.vllm import VLLMEngine

    return VLLMEngine.from_policy(policy, tokenizer, **kwargs)


def _vllm_options(rollout, policy, tokenizer, task, lora_r: int, sample: int) -> dict:
    from qerl_kit.rollout.vllm import vllm_options

    return vllm_options(rollout, policy, tokenizer, task, lora_r=lora_r, sample=sample)


ENGINES: dict[str, Callable[..., Any]] = {"hf": _hf, "static": _static, "vllm": _vllm}
# A backend's options function: (rollout config, policy, tokenizer, task, lora_r=, sample=) -> the keyword
# arguments its factory takes from the run (vLLM: the context length and GPU memory share, rollout/vllm.py).
ENGINE_OPTIONS: dict[str, Callable[..., dict]] = {"vllm": _vllm_options}


def register_engine(name: str, factory: Callable[..., Any], options: Callable[..., dict] | None = None) -> None:
    """Make ``name`` a rollout backend: ``factory(policy, tokenizer, **kwargs)`` returns the engine;
    ``options`` (optional) gives the keyword arguments it takes from a run (see ``engine_options``)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"an engine name must be a non-empty string other than 'auto'; got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of engine {name!r} must be callable; got {type(factory).__name__}")
    if options is not None and not callable(options):
        raise TypeError(f"the options of engine {name!r} must be callable or None; got {type(options).__name__}")
    ENGINES[name] = factory
    if options is not None:
        ENGINE_OPTIONS[name] = options
    else:
        ENGINE_OPTIONS.pop(name, None)


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
    """The keyword arguments the Trainer gives ``make_engine`` for ``rollout`` (a RolloutConfig): what
    the backend's options function (``ENGINE_OPTIONS``, ``register_engine(options=)``) reads from the
    run's rollout config, task and LoRA rank; ``{}`` for a backend without one (hf, static)."""
    options = ENGINE_OPTIONS.get(resolve_engine(rollout.engine, policy))
    return options(rollout, policy, tokenizer, task, lora_r=lora_r, sample=sample) if options else {}
