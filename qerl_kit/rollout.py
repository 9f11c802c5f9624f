"""Rollouts: sample n completions per prompt, with the log-probs of the distribution sampled from.

One narrow interface, several backends. ``RolloutEngine.generate(prompts, n, sampling)`` takes
prompt *texts* and returns ``Rollouts``: token ids, masks, per-token sampling log-probs, decoded
texts and finish reasons, group-contiguous (prompt i's n samples are rows i*n .. i*n+n-1), the
layout ``qerl_kit.grpo.group_advantages`` expects. ``HFEngine`` wraps transformers' ``generate``
(CPU or GPU, plain or peft model, quantized or not); a vLLM engine and our own GPU engine fill the
same ``Rollouts`` (``Rollouts.from_lists`` is the constructor for backends that return lists).

Log-prob semantics: ``logprobs[r, t]`` is log pi_sample(token_t | prefix), where pi_sample is the
distribution the token was actually drawn from: softmax of the logits after temperature, then
top-k, then top-p (renormalized over the kept tokens), like vLLM's ``logprobs_mode=
"processed_logprobs"``. Greedy decoding (temperature 0) reports log_softmax of the raw logits.
The trainer's log-probs are those of the policy at temperature T on the same tokens; with top-p/k
at 1/0 they agree up to numerics (quantized kernels, AQN noise, batch shapes), and the gap is what
``qerl_kit.grpo.importance_weights`` corrects.

HFEngine mechanics, and where it departs from a plain ``model.generate(num_return_sequences=n)``:

* Prompts are tokenized without padding and left-padded here with ``pad_token_id`` (else
  ``eos``); the user's tokenizer is never mutated. ``add_special_tokens=False`` by default, as TRL
  does, since chat-templated prompts already hold their special tokens.
* Prefill sharing (``share_prefill=True``): the B unique prompts minus their last token run once
  through the model, the KV cache is expanded with ``Cache.batch_repeat_interleave(n)``, and
  ``generate`` resumes from it on the n-times expanded ids (it feeds only the last prompt token;
  position ids come from the attention mask, as in the prefix forward). Prefill work drops by n.
* Temperature/top-k/top-p run in one logits processor of ours, the last in generate's list, that
  also records each step's log-softmax: memory is one [rows, vocab] float32 buffer instead of
  ``output_scores``'s [rows, steps, vocab]. Sampling fields the model's ``generation_config`` may
  carry (Qwen's repetition_penalty, top_k=20 ...) are overridden with neutral values.
* Stop tokens: tokenizer eos, the model's ``generation_config.eos_token_id`` (one id or a list)
  and ``stop_token_ids``. The stop token counts as a completion token (mask 1, its log-prob is
  kept) but is left out of ``texts``.
* ``seed``: the sampling RNG (global CPU generator, and the model's CUDA device's) is forked with
  ``torch.random.fork_rng``, seeded, and restored afterwards, so the caller's RNG stream is left
  exactly where it was. Samples then depend on seed, prompts, ``batch_size`` and device; the same
  call gives the same tokens. ``seed=None`` draws from (and advances) the global RNG.
* The model runs in eval mode under ``torch.no_grad``; every module's train/eval flag is restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

__all__ = ["SamplingParams", "Rollouts", "RolloutEngine", "HFEngine"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0   # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 = off
    seed: int | None = None    # seeds the sampling RNG for reproducibility

    def __post_init__(self):
        # Errors read "<field> must be <allowed>; got <repr(value)>", as configs' do. Bools are not
        # numbers here; numpy scalars are.
        import math
        import numbers

        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_real(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int; got {self.max_new_tokens!r}")
        # 0 means greedy (evaluation); inf would flatten the logits to uniform and nan poisons them
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy); got {self.temperature!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:  # nan fails the comparison
            raise ValueError(f"top_p must be a float in (0, 1] (1 = off); got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off); got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None (None = the global RNG); got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _pad(rows: Sequence[Tensor], pad: float | int, left: bool, dtype=None) -> Tensor:
    """Stack 1-D tensors of different lengths into [len(rows), max_len], padded left or right."""
    width = max((len(r) for r in rows), default=0)
    ref = rows[0] if len(rows) else torch.zeros(0, dtype=torch.long)
    out = torch.full((len(rows), width), pad, dtype=dtype or ref.dtype, device=ref.device)
    for i, r in enumerate(rows):
        if len(r):
            if left:
                out[i, width - len(r):] = r
            else:
                out[i, :len(r)] = r
    return out


def _repad(x: Tensor, width: int, pad: float | int, left: bool) -> Tensor:
    """Widen [rows, w] to [rows, width] with ``pad`` on the left or right."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    fill = x.new_full((x.shape[0], extra), pad)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


@dataclass
class Rollouts:
    prompts: list[str]            # len B*n, each prompt repeated n times, group-contiguous
    prompt_ids: Tensor            # [B*n, P] left-padded with pad_token_id
    prompt_mask: Tensor           # [B*n, P] 1 on real prompt tokens
    completion_ids: Tensor        # [B*n, C] right-padded with pad_token_id
    completion_mask: Tensor       # [B*n, C] 1 on real completion tokens, stop token included
    logprobs: Tensor              # [B*n, C] float32 sampling log-probs, 0 on padding
    texts: list[str]              # decoded completions (special tokens and stop token skipped)
    finish_reasons: list[str]     # "stop" (EOS / stop token) or "length"
    group_size: int
    pad_token_id: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        rows = self.prompt_ids.shape[0]
        if self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"prompt_mask {tuple(self.prompt_mask.shape)} != prompt_ids "
                             f"{tuple(self.prompt_ids.shape)}")
        for name in ("completion_mask", "logprobs"):
            if getattr(self, name).shape != self.completion_ids.shape:
                raise ValueError(f"{name} {tuple(getattr(self, name).shape)} != completion_ids "
                                 f"{tuple(self.completion_ids.shape)}")
        lengths = {len(self.prompts), len(self.texts), len(self.finish_reasons), self.completion_ids.shape[0]}
        if lengths != {rows}:
            raise ValueError(f"Rollouts fields disagree on the number of rows: {sorted(lengths)} vs {rows}")
        if self.group_size < 1 or rows % self.group_size:
            raise ValueError(f"{rows} rows do not split into groups of {self.group_size}")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_ids(self) -> Tensor:           # [B*n, P+C] prompt then completion
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:      # [B*n, P+C]
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> Tensor:  # [B*n] number of completion tokens, stop token included
        return self.completion_mask.sum(dim=1)

    def to(self, device: torch.device | str) -> "Rollouts":
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **moved, stats=dict(self.stats))

    def __repr__(self) -> str:
        lengths = self.completion_lengths.float()
        stop = sum(r == "stop" for r in self.finish_reasons) / max(len(self), 1)
        return (f"Rollouts({len(self) // self.group_size} prompts x {self.group_size}, prompt len "
                f"{self.prompt_ids.shape[1]}, completion len mean {lengths.mean().item():.1f} max "
                f"{self.completion_ids.shape[1]}, {stop:.0%} stopped, {int(lengths.sum())} tokens)")

    @classmethod
    def from_lists(cls, prompts: Sequence[str], prompt_token_ids: Sequence[Sequence[int]],
                   completion_token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]],
                   texts: Sequence[str], finish_reasons: Sequence[str], group_size: int,
                   pad_token_id: int, stats: dict | None = None) -> "Rollouts":
        """Build from per-row lists (what vLLM returns); completion ids include the stop token."""
        long = lambda rows: [torch.tensor(list(r), dtype=torch.long) for r in rows]  # noqa: E731
        p_ids, c_ids = long(prompt_token_ids), long(completion_token_ids)
        return cls(list(prompts), _pad(p_ids, pad_token_id, left=True),
                   _pad([torch.ones_like(r) for r in p_ids], 0, left=True),
                   _pad(c_ids, pad_token_id, left=False),
                   _pad([torch.ones_like(r) for r in c_ids], 0, left=False),
                   _pad([torch.tensor(list(r), dtype=torch.float32) for r in logprobs], 0.0, left=False,
                        dtype=torch.float32),
                   list(texts), list(finish_reasons), group_size, pad_token_id, dict(stats or {}))

    def select(self, rows: Sequence[int] | Tensor) -> "Rollouts":
        """These rows (whole groups, e.g. the groups DAPO keeps), with all-padding columns trimmed."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_ids.device).flatten()
        if len(idx) % self.group_size:
            raise ValueError(f"selected {len(idx)} rows: not whole groups of {self.group_size}")
        pm, cm = self.prompt_mask[idx], self.completion_mask[idx]
        P = self.prompt_ids.shape[1] - (int(pm.sum(1).max()) if len(idx) else 0)  # first kept column
        C = int(cm.sum(1).max()) if len(idx) else 0
        rows_l = idx.tolist()
        return Rollouts([self.prompts[i] for i in rows_l], self.prompt_ids[idx, P:], pm[:, P:],
                        self.completion_ids[idx, :C], cm[:, :C], self.logprobs[idx, :C],
                        [self.texts[i] for i in rows_l], [self.finish_reasons[i] for i in rows_l],
                        self.group_size, self.pad_token_id, dict(self.stats))

    @classmethod
    def concat(cls, parts: Sequence["Rollouts"]) -> "Rollouts":
        """Concatenate rollouts (micro-batches, DAPO refills) of one group size, re-padding."""
        if not parts:
            raise ValueError("Rollouts.concat needs at least one Rollouts")
        if len({p.group_size for p in parts}) != 1:
            raise ValueError(f"cannot concatenate group sizes {sorted({p.group_size for p in parts})}")
        pad, P = parts[0].pad_token_id, max(p.prompt_ids.shape[1] for p in parts)
        C = max(p.completion_ids.shape[1] for p in parts)
        cat = lambda name, width, value, left: torch.cat(  # noqa: E731
            [_repad(getattr(p, name), width, value, left) for p in parts])
        stats = {k: sum(p.stats.get(k, 0.0) for p in parts) for k in ("rollout/tokens", "rollout/seconds")
                 if all(k in p.stats for p in parts)}
        if stats.get("rollout/seconds"):
            stats["rollout/tokens_per_s"] = stats["rollout/tokens"] / stats["rollout/seconds"]
        return cls([s for p in parts for s in p.prompts], cat("prompt_ids", P, pad, True),
                   cat("prompt_mask", P, 0, True), cat("completion_ids", C, pad, False),
                   cat("completion_mask", C, 0, False), cat("logprobs", C, 0.0, False),
                   [t for p in parts for t in p.texts], [r for p in parts for r in p.finish_reasons],
                   parts[0].group_size, pad, stats)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], n: int, sampling: SamplingParams) -> Rollouts: ...


def _check_request(prompts: Any, n: Any) -> list[str]:
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, not one string; wrap it: [prompt]")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: nothing to generate")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("every prompt must be a string (render chat messages with "
                        "qerl_kit.data.build_prompt or tokenizer.apply_chat_template first)")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1; got {n!r}")
    return prompts


def _check_context(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, model: Any) -> None:
    """Refuse a prompt that, with ``max_new_tokens`` after it, needs more positions than the model
    has (``config.max_position_embeddings``): transformers would only warn and then decode garbage."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    limit = getattr(getattr(base, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                             f"{len(ids) + max_new_tokens} positions, more than the model's context "
                             f"(max_position_embeddings={limit}): shorten it (a prompt_fn may truncate) or lower "
                             "rollout.max_new_tokens")


class _SampleAndRecord:
    """The last logits processor: temperature -> top-k -> top-p, and each sampled token's log-prob.

    At step t it sees the ids up to step t-1, so it gathers the log-prob of token t-1 from the
    log-softmax it kept from step t-1; ``finish`` gathers the last one.
    """

    def __init__(self, sampling: SamplingParams, prompt_len: int):
        from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                            TopPLogitsWarper)
        self.prompt_len, self.logps, self.prev = prompt_len, [], None
        self.warpers = []
        if not sampling.greedy:
            if sampling.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k:
                self.warpers.append(TopKLogitsWarper(sampling.top_k))
            if sampling.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(sampling.top_p))

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[1] > self.prompt_len:  # gather the token sampled at the previous step
            self.logps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, completion_ids: Tensor) -> Tensor:  # [rows, C] float32
        C, done = completion_ids.shape[1], len(self.logps)
        if done < C:  # the last token: sampled from the last step's distribution
            self.logps.append(self.prev.gather(1, completion_ids[:, done:done + 1]).squeeze(1))
        self.prev = None
        # generate may run (and undo) one extra step on some devices: keep the first C entries
        return torch.stack(self.logps[:C], dim=1)


@contextlib.contextmanager
def _inference(model: torch.nn.Module):
    """Eval mode and no_grad; restores every module's own train/eval flag afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
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


def _special_ids(tokenizer: Any, model: torch.nn.Module | None,
                stop_token_ids: Sequence[int] | None = None) -> tuple[int | None, list[int]]:
    """(pad id, stop ids) for an engine: pad = the tokenizer's pad, else its first EOS (None if it
    has neither); stop ids = tokenizer EOS + the model's ``generation_config`` EOS + extra ids."""
    eos = _as_ids(getattr(tokenizer, "eos_token_id", None))
    pad = getattr(tokenizer, "pad_token_id", None)
    config_eos = _as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    stop = list(dict.fromkeys(eos + config_eos + _as_ids(stop_token_ids)))
    return (int(pad) if pad is not None else (eos[0] if eos else None)), stop


def _stop_mask(completion: Tensor, stop_token_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(mask [rows, C] long, stopped [rows] bool): a row ends at its first stop token, which
    counts as a completion token; a row with none runs to C."""
    stop_ids = torch.tensor(list(stop_token_ids), dtype=torch.long, device=completion.device)
    is_stop = torch.isin(completion, stop_ids)
    stopped = is_stop.any(dim=1)
    first = torch.where(stopped, is_stop.int().argmax(dim=1), completion.shape[1] - 1)
    mask = (torch.arange(completion.shape[1], device=completion.device)[None, :] <= first[:, None]).long()
    return mask, stopped


def _decode_completions(tokenizer: Any, completion: Tensor, mask: Tensor, stopped: Tensor) -> list[str]:
    """Texts of the completions: the masked tokens without the stop token, special tokens skipped."""
    lengths, stopped_l = mask.sum(1).tolist(), stopped.tolist()
    text_ids = [row[:L - s].tolist() for row, L, s in zip(completion.cpu(), lengths, stopped_l)]
    return tokenizer.batch_decode(text_ids, skip_special_tokens=True)


class HFEngine:
    """Rollouts through ``model.generate`` (transformers), with prefill sharing and sampling log-probs.

    ``batch_size``: prompts per ``generate`` call (each expands to ``batch_size * n`` rows);
    None = all at once. ``stop_token_ids``: extra ids that end a completion. ``share_prefill``:
    prefill each prompt once for its n samples (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, batch_size: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, share_prefill: bool = True,
                 add_special_tokens: bool = False):
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be None or an int >= 1; got {batch_size!r}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.share_prefill = batch_size, share_prefill
        self.add_special_tokens = add_special_tokens
        pad, self.stop_token_ids = _special_ids(tokenizer, model, stop_token_ids)
        if pad is None:
            raise ValueError("the tokenizer has neither a pad_token_id nor an eos_token_id; set one")
        self.pad_token_id = pad
        if not self.stop_token_ids:
            warnings.warn("no EOS or stop token id known: every completion runs to max_new_tokens")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x renamed it
        self._logits_to_keep = "logits_to_keep" in params
        from qerl_kit.quantize import prepare_kernels

        prepare_kernels(model)  # on a GPU: humming's NVFP4 kernels compile now, not in the first generate

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: list[str], n: int = 1, sampling: SamplingParams | None = None) -> Rollouts:
        prompts = _check_request(prompts, n)
        sampling = sampling or SamplingParams()
        start = time.perf_counter()
        encoded = self.tokenizer(prompts, add_special_tokens=self.add_special_tokens)["input_ids"]
        empty = [i for i, ids in enumerate(encoded) if len(ids) == 0]
        if empty:
            raise ValueError(f"prompts {empty[:5]} tokenize to zero tokens; nothing to condition on")
        _check_context(encoded, sampling.max_new_tokens, self.model)
        step = self.batch_size or len(prompts)
        with _inference(self.model), _seeded(sampling.seed, self.device):
            parts = [self._generate_batch(prompts[i:i + step], encoded[i:i + step], n, sampling)
                     for i in range(0, len(prompts), step)]
        out = parts[0] if len(parts) == 1 else Rollouts.concat(parts)
        seconds = time.perf_counter() - start
        tokens = int(out.completion_mask.sum())
        out.stats = {"rollout/tokens": tokens, "rollout/seconds": seconds,
                     "rollout/tokens_per_s": tokens / max(seconds, 1e-9)}
        return out

    # ---- one micro-batch --------------------------------------------------------------------
    def _generation_config(self, sampling: SamplingParams):
        from transformers import GenerationConfig

        # Neutral values for every score-changing field a checkpoint's generation_config may set
        # (generate fills fields we leave None from model.generation_config). Temperature, top-k
        # and top-p are ours (_SampleAndRecord), so generate's own warpers stay off.
        # (top_k=50 is what greedy validation expects; greedy ignores the warpers anyway.)
        neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0, num_beams=1,
                       num_return_sequences=1, renormalize_logits=False, temperature=1.0, top_p=1.0,
                       top_k=50 if sampling.greedy else 0, typical_p=1.0, epsilon_cutoff=0.0,
                       eta_cutoff=0.0)
        model_config = getattr(self.model, "generation_config", None)
        if not sampling.greedy and getattr(model_config, "min_p", None) is not None:
            neutral["min_p"] = 0.0  # keeps every token
        return GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=not sampling.greedy,
                                eos_token_id=self.stop_token_ids or None, pad_token_id=self.pad_token_id,
                                use_cache=True, **neutral)

    def _prefill(self, ids: Tensor, mask: Tensor, positions: Tensor, n: int):
        """KV cache of ids[:, :-1] for the B unique prompts, expanded to B*n rows; None if unsupported."""
        kwargs = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                         position_ids=positions[:, :-1], use_cache=True, **kwargs)
        cache = getattr(out, "cache", None)
        cache = getattr(out, "past_key_values", None) if cache is None else cache
        if cache is None or not hasattr(cache, "batch_repeat_interleave"):
            warnings.warn(f"{type(cache).__name__} cannot be expanded per sample; share_prefill disabled "
                          "for this call", stacklevel=3)
            return None
        cache.batch_repeat_interleave(n)
        return cache

    def _generate_batch(self, prompts: list[str], encoded: list[list[int]], n: int,
                        sampling: SamplingParams) -> Rollouts:
        device = self.device
        ids = _pad([torch.tensor(e, dtype=torch.long) for e in encoded], self.pad_token_id, left=True)
        ids = ids.to(device)
        mask = _pad([torch.ones(len(e), dtype=torch.long) for e in encoded], 0, left=True).to(device)
        P = ids.shape[1]
        kwargs = {}
        if self.share_prefill and n > 1 and P > 1:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate derives from the mask
            cache = self._prefill(ids, mask, positions, n)
            if cache is not None:
                kwargs[self._cache_kw] = cache
        ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        recorder = _SampleAndRecord(sampling, P)
        from transformers import LogitsProcessorList

        sequences = self.model.generate(input_ids=ids, attention_mask=mask,
                                        generation_config=self._generation_config(sampling),
                                        logits_processor=LogitsProcessorList([recorder]), **kwargs)
        completion = sequences[:, P:]
        logprobs = recorder.finish(completion)
        # The first stop token ends a completion; everything after it is padding from generate.
        cmask, stopped = _stop_mask(completion, self.stop_token_ids)
        completion = torch.where(cmask.bool(), completion, self.pad_token_id)
        texts = _decode_completions(self.tokenizer, completion, cmask, stopped)
        return Rollouts([p for p in prompts for _ in range(n)], ids, mask, completion, cmask,
                        torch.where(cmask.bool(), logprobs, 0.0), texts,
                        ["stop" if s else "length" for s in stopped.tolist()], n, self.pad_token_id)
