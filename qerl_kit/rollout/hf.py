"""``HFEngine``: rollouts through transformers' ``generate`` (CPU or GPU, plain or peft model,
quantized or not), with prefill sharing and each sampled token's log-prob.

HFEngine mechanics, and where it departs from a plain ``model.generate(num_return_sequences=n)``:

* Prompt ids (``Prompts``) are left-padded here with ``pad_token_id`` (else ``eos``); the user's
  tokenizer is never mutated.
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

import inspect
import warnings
from typing import Any, Sequence

import torch
from torch import Tensor

from qerl_kit.finite import logits_error
from qerl_kit.rollout.base import ModelEngine, check_context, inference, seeded, special_ids, stop_mask
from qerl_kit.rollout.types import Generation, Prompts, SamplingParams, as_prompts, check_n, pad_rows

__all__ = ["HFEngine"]


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



class HFEngine(ModelEngine):
    """Rollouts through ``model.generate`` (transformers), with prefill sharing and sampling log-probs.

    ``batch_size``: prompts per ``generate`` call (each expands to ``batch_size * n`` rows);
    None = all at once. ``stop_token_ids``: extra ids that end a completion (ints in the
    model's vocabulary, checked here: ``check_stop_ids``). ``share_prefill``:
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
        pad, self.stop_token_ids = special_ids(tokenizer, model, stop_token_ids)
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

    def generate_ids(self, prompts: Prompts | Sequence[Sequence[int]], n: int = 1,
                     sampling: SamplingParams | None = None) -> Generation:
        """Token-level generation: ``Generation`` of ``len(prompts) * n`` group-contiguous rows."""
        prompts = as_prompts(prompts, self.tokenizer, self.add_special_tokens)
        n, sampling = check_n(n), sampling or SamplingParams()
        check_context(prompts.ids, sampling.max_new_tokens, self.model)
        step = self.batch_size or len(prompts)
        with inference(self.model), seeded(sampling.seed, self.device):
            parts = [self._generate_batch(prompts.ids[i:i + step], n, sampling) for i in range(0, len(prompts), step)]
        return Generation.concat(parts, self.pad_token_id)

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

    def _generate_batch(self, encoded: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Generation:
        device = self.device
        ids = pad_rows([torch.tensor(e, dtype=torch.long) for e in encoded], self.pad_token_id, left=True)
        ids = ids.to(device)
        mask = pad_rows([torch.ones(len(e), dtype=torch.long) for e in encoded], 0, left=True).to(device)
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

        try:
            sequences = self.model.generate(input_ids=ids, attention_mask=mask,
                                            generation_config=self._generation_config(sampling),
                                            logits_processor=LogitsProcessorList([recorder]), **kwargs)
        except RuntimeError as err:  # torch.multinomial on NaN/inf probabilities: say which step and why
            if recorder.prev is not None and not bool(torch.isfinite(recorder.prev).any(dim=-1).all()):
                raise logits_error(self.model, len(recorder.logps)) from err
            raise
        completion = sequences[:, P:]
        logprobs = recorder.finish(completion)
        # The first stop token ends a completion; everything after it is padding from generate.
        cmask, stopped = stop_mask(completion, self.stop_token_ids)
        completion = torch.where(cmask.bool(), completion, self.pad_token_id)
        return Generation(ids, mask, completion, cmask, torch.where(cmask.bool(), logprobs, 0.0), stopped)
