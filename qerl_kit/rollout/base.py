"""The rollout interface and what every backend shares.

An engine is two calls:

* ``with engine.sync(policy, noise=aqn, step=step) as info:`` the step before generation. An
  engine that reads the policy's own tensors (``ModelEngine``: transformers' generate, our
  StaticEngine) has nothing to upload; under AQN it puts the step's noise into the policy's norm
  scales for the block and takes it out after, so no training forward ever sees it. An engine
  with its own copy of the weights (vLLM) uploads the adapter and the (noisy) norms here, waking
  up first when it sleeps between rollouts. ``info`` holds what the sync did (``aqn/norms``).
* ``engine.generate(prompts, n, sampling) -> Rollouts``: ``prompts`` are ``Prompts`` (token ids,
  tokenized once by ``Prompts.encode``); a list of texts or of id lists is accepted too and goes
  through the same function. ``generate_ids`` is the token-level call underneath, returning a
  ``Generation`` without texts.

``Engine`` implements ``generate`` on top of a backend's ``generate_ids``; backends subclass
``ModelEngine`` (shared memory) or ``Engine`` (their own weights), and register in
``qerl_kit.rollout.registry``.
"""

from __future__ import annotations

import contextlib
import operator
import time
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from qerl_kit.chat_tokens import chat_stop_ids
from qerl_kit.config_types import short_repr
from qerl_kit.finite import check_logprobs
from qerl_kit.rollout.types import Generation, Prompts, Rollouts, SamplingParams, as_prompts, check_n

__all__ = ["RolloutEngine", "Engine", "ModelEngine", "check_engine", "check_context", "check_token_ids",
           "check_stop_ids", "inference", "seeded", "special_ids", "stop_mask", "decode_completions"]


@runtime_checkable
class RolloutEngine(Protocol):
    def sync(self, policy: Any = None, *, noise: Any = None, step: int = 0) -> contextlib.AbstractContextManager: ...

    def generate(self, prompts: Any, n: int, sampling: SamplingParams) -> Rollouts: ...


class Engine:
    """``generate`` = ``as_prompts`` + the backend's ``generate_ids`` + decoded texts and timing."""

    tokenizer: Any = None
    add_special_tokens: bool = False
    pad_token_id: int = 0
    stop_token_ids: list[int] = []

    def generate_ids(self, prompts: Prompts | Sequence[Sequence[int]], n: int = 1,
                     sampling: SamplingParams | None = None) -> Generation:  # pragma: no cover - abstract
        raise NotImplementedError

    def generate(self, prompts: Prompts | Sequence[str] | Sequence[Sequence[int]], n: int = 1,
                 sampling: SamplingParams | None = None) -> Rollouts:
        prompts = as_prompts(prompts, self.tokenizer, self.add_special_tokens)
        n, sampling = check_n(n), sampling or SamplingParams()
        start = time.perf_counter()
        gen, texts = self._generate_texts(prompts, n, sampling)
        # one reduction: NaN logits sample (greedy/Gumbel argmax) without failing; their log-prob is NaN
        check_logprobs(gen.logprobs, gen.completion_mask, getattr(self, "model", None))
        seconds = time.perf_counter() - start
        tokens = int(gen.completion_mask.sum())
        return Rollouts.from_generation(prompts, gen, n, texts, self.pad_token_id, {
            "rollout/tokens": tokens, "rollout/seconds": seconds, "rollout/tokens_per_s": tokens / max(seconds, 1e-9)})

    def _generate_texts(self, prompts: Prompts, n: int, sampling: SamplingParams) -> tuple[Generation, list[str]]:
        """``generate_ids`` and the completions decoded with the engine's tokenizer (a backend that
        decodes itself, like vLLM, overrides this)."""
        if self.tokenizer is None:
            raise ValueError(f"this {type(self).__name__} has no tokenizer to decode completions with; pass one, "
                             "or call generate_ids")
        gen = self.generate_ids(prompts, n, sampling)
        return gen, decode_completions(self.tokenizer, gen.completion_ids, gen.completion_mask, gen.stopped)

    def sync(self, policy: Any = None, *, noise: Any = None, step: int = 0):  # pragma: no cover - abstract
        raise NotImplementedError


class ModelEngine(Engine):
    """An engine that generates with ``self.model``'s own tensors: sync uploads nothing."""

    model: torch.nn.Module

    @contextlib.contextmanager
    def sync(self, policy: Any = None, *, noise: Any = None, step: int = 0) -> Iterator[dict]:
        """Under ``noise`` (an ``qerl_kit.aqn.AQN``), the step's noise in the norm scales for the block.

        ``policy`` defaults to the engine's model; it must be the model the engine reads (or the peft
        wrapper around it), since noise put into another model would never reach the rollout."""
        target = self.model if policy is None else policy
        if policy is not None and not _same_model(policy, self.model):
            raise ValueError(f"{type(self).__name__} generates with its own model, not the policy passed to sync(); "
                             "build the engine on the policy (make_engine(name, policy, tokenizer))")
        if noise is None:
            yield {}
            return
        with noise.noise(target, step) as count:
            yield {"aqn/norms": count}


def check_engine(engine: Any) -> Any:
    """``engine`` itself when it has the rollout interface (``sync`` and ``generate``), else a TypeError
    naming what it lacks. The Trainer and ``evaluate`` check an engine they are given with it, then
    call ``engine.sync(policy, noise=, step=)``: the one way to prepare a rollout."""
    missing = [name for name in ("sync", "generate") if not callable(getattr(engine, name, None))]
    if missing:
        raise TypeError(f"{type(engine).__name__} is not a rollout engine: it has no {' or '.join(missing)} "
                        "method. An engine needs sync(policy, noise=, step=) (a context manager: the step before "
                        "generation, where AQN noise and adapter uploads happen) and generate(prompts, n, "
                        "sampling); subclass qerl_kit.rollout.ModelEngine (an engine that reads the policy's own "
                        "tensors: its sync is written) or implement both")
    return engine


def _same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    unwrap = lambda m: m.get_base_model() if hasattr(m, "get_base_model") else m  # noqa: E731
    return a is b or unwrap(a) is unwrap(b)


def check_context(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, model: Any) -> None:
    """Refuse a prompt that, with ``max_new_tokens`` after it, needs more positions than the model
    has (``config.max_position_embeddings``): transformers would only warn and then decode garbage.
    And a token id outside the model's vocabulary (``check_token_ids``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_token_ids(prompt_ids, _vocab_size(base))
    limit = getattr(getattr(base, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{len(ids) + max_new_tokens} positions, more than the model's context "
                             f"(max_position_embeddings={limit}): shorten it (a prompt_fn may truncate) or lower "
                             "rollout.max_new_tokens")


def _vocab_size(model: Any) -> int | None:
    """Rows of the input embedding (what an id indexes), else ``config.vocab_size``; None if unknown."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    rows = rows if rows is not None else getattr(getattr(model, "config", None), "vocab_size", None)
    return rows if isinstance(rows, int) and rows > 0 else None


def check_token_ids(prompt_ids: Sequence[Sequence[int]], vocab_size: int | None) -> None:
    """Every prompt token id in [0, vocab_size): a wrong id would fail deep in the embedding with
    ``IndexError: index out of range in self`` (or, on a GPU, a device-side assert)."""
    for i, ids in enumerate(prompt_ids):
        if not ids:
            continue
        low, high = min(ids), max(ids)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            allowed = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"prompt {i} has token id {bad}; token ids must be {allowed} (the model's vocabulary "
                             f"size is {vocab_size if vocab_size is not None else 'unknown'})")


def check_stop_ids(stop_token_ids: Any, vocab_size: int | None, key: str = "stop_token_ids") -> list[int]:
    """The extra stop ids an engine is built with, checked there (every engine: HF, static, vLLM): None
    (none), one id or a list of ids, each an int in [0, vocab_size). An id outside the vocabulary is never
    generated, so it would never stop a row; a float would be truncated to another token; a string would
    be read as its characters. ``vocab_size`` None: only ``>= 0`` is checked."""
    allowed = (f"None or token ids (ints in [0, {vocab_size}), the model's vocabulary)" if vocab_size is not None
               else "None or token ids (ints >= 0)")
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, (str, bytes)):
        raise TypeError(f"{key} must be {allowed}; got {short_repr(stop_token_ids)} (a token's text: pass its id, "
                        "tokenizer.convert_tokens_to_ids(token))")
    try:
        items = [stop_token_ids] if _is_id(stop_token_ids) else list(stop_token_ids)
    except TypeError:
        raise TypeError(f"{key} must be {allowed}; got {short_repr(stop_token_ids)}") from None
    ids = []
    for item in items:
        if not _is_id(item):
            raise TypeError(f"{key} must be {allowed}; got {short_repr(item)} in {short_repr(stop_token_ids)}")
        ids.append(operator.index(item))
        if ids[-1] < 0 or (vocab_size is not None and ids[-1] >= vocab_size):
            raise ValueError(f"{key} must be {allowed}; got {ids[-1]} (an id outside the vocabulary is never "
                             "generated, so it would never stop a completion)")
    return ids


def _is_id(value: Any) -> bool:
    """An int-like token id (int, numpy or 0-d torch integer), never a bool or a float."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return False
    if isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim() != 0):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def inference(model: torch.nn.Module):
    """Eval mode and no_grad; restores every module's own train/eval flag afterwards. On the CPU,
    4-bit weights are dequantized once for the whole block (``qerl_kit.dense_cache``)."""
    from qerl_kit.dense_cache import dense_weight_cache

    modes = [(m, m.training) for m in model.modules()]
    first = next(model.parameters(), None)
    on_cpu = first is None or first.device.type == "cpu"
    model.eval()
    try:
        with torch.no_grad(), dense_weight_cache(enabled=on_cpu):
            yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device):
    """Seed the global CPU RNG (and the CUDA device's) inside a fork; restore both on exit."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def special_ids(tokenizer: Any, model: torch.nn.Module | None,
                stop_token_ids: Sequence[int] | None = None) -> tuple[int | None, list[int]]:
    """(pad id, stop ids) for an engine: pad = the tokenizer's pad, else its first EOS (None if it
    has neither); stop ids = tokenizer EOS + the model's ``generation_config`` EOS + the chat
    template's turn end (``chat_stop_ids``) + extra ids (``check_stop_ids``: ints in the model's vocabulary)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    extra = check_stop_ids(stop_token_ids, None if base is None else _vocab_size(base))
    eos = _as_ids(getattr(tokenizer, "eos_token_id", None))
    pad = getattr(tokenizer, "pad_token_id", None)
    config_eos = _as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    stop = list(dict.fromkeys(eos + config_eos + chat_stop_ids(tokenizer) + extra))
    return (int(pad) if pad is not None else (eos[0] if eos else None)), stop


def stop_mask(completion: Tensor, stop_token_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(mask [rows, C] long, stopped [rows] bool): a row ends at its first stop token, which
    counts as a completion token; a row with none runs to C."""
    stop_ids = torch.tensor(list(stop_token_ids) or [-1], dtype=torch.long, device=completion.device)
    is_stop = torch.isin(completion, stop_ids)
    stopped = is_stop.any(dim=1)
    first = torch.where(stopped, is_stop.int().argmax(dim=1), completion.shape[1] - 1)
    mask = (torch.arange(completion.shape[1], device=completion.device)[None, :] <= first[:, None]).long()
    return mask, stopped


def decode_completions(tokenizer: Any, completion: Tensor, mask: Tensor, stopped: Tensor) -> list[str]:
    """Texts of the completions: the masked tokens without the stop token, special tokens skipped."""
    lengths, stopped_l = mask.sum(1).tolist(), stopped.tolist()
    text_ids = [row[:L - s].tolist() for row, L, s in zip(completion.cpu(), lengths, stopped_l)]
    return tokenizer.batch_decode(text_ids, skip_special_tokens=True)
