"""``StaticEngine``: rollouts with a static KV cache, shared prefill and CUDA-graph decode steps.

A backend of ``qerl_kit.rollout``'s interface (``generate(prompts, n, sampling) -> Rollouts``,
``generate_ids`` -> ``Generation``), built for the RL loop's shape of work: the same number of rows and completion length step after
step, a policy whose LoRA weights and AQN norm noise change in place between calls.

How one call runs:

1. Prompt ids are left-padded to a width P rounded up to ``prompt_bucket`` (so calls of
   similar prompt lengths reuse one cache and its graphs), and prefilled once per unique prompt,
   in chunks of at most ``max_prefill_tokens``; keys/values are written to each of the prompt's n
   cache rows. The first completion token of every row is sampled from the prefill's logits.
2. Each decode step (one token for every row) runs the model's own modules through
   ``qerl_kit.engine.decoder``, samples on the device (``qerl_kit.engine.sampler``), writes the
   token and its log-prob into output buffers and advances its own counters (slot, positions,
   step) on the device. On CUDA the step is captured once per attention length bucket
   (``length_bucket`` slots: attention reads only the part of the cache in use) and replayed;
   the host loop does nothing else but check, every ``sync_every`` steps, whether every row has
   stopped.
3. Rows stop at a stop token (EOS, the model's ``generation_config`` EOS ids, ``stop_token_ids``)
   or at ``max_new_tokens``; ``ignore_eos=True`` (benchmarks) runs every row to the full length.

What the graphs bake in, and what they read live: tensor *storage* is fixed at capture, values
are read at replay. LoRA matrices updated in place by an optimizer, AQN's in-place norm noise and
``NVFP4Linear`` buffers are therefore live. Python-level state is baked in: sampling parameters
(part of the graph key), which adapter is active, ``disable_adapter()``, module hooks. Forward
hooks (e.g. AQN's ``resample="forward"``) would not rerun at replay, so a model that has any runs
eagerly, with a warning. Replacing a parameter object (not its values) needs ``reset()``.

Sampling RNG: ``seed`` forks and seeds the default generators, as ``HFEngine`` does; samples
depend on seed, prompts, rows and device.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from qerl_kit.engine.decoder import Decoder, KVCache
from qerl_kit.engine.sampler import sample
from qerl_kit.rollout.base import ModelEngine, check_context, inference, seeded, special_ids, stop_mask
from qerl_kit.rollout.types import Generation, Prompts, SamplingParams, as_prompts, check_n, pad_rows

__all__ = ["StaticEngine"]


@dataclass
class _State:
    """Buffers for one (rows, prompt width, completion length) shape; graphs captured on them."""

    cache: KVCache
    tok: Tensor        # [R] the token fed at the next step
    pos: Tensor        # [R] its position id
    slot: Tensor       # [1] the cache column it is written to
    step: Tensor       # [1] the output column of the token sampled next
    done: Tensor       # [R] bool: row has emitted a stop token
    key_bias: Tensor   # [R, L] additive attention bias: 0 on keys a row may attend to, -inf elsewhere
    out_tok: Tensor    # [R, C]
    out_lp: Tensor     # [R, C] float32
    stop: Tensor       # [S] stop ids (at least one entry; -1 when there is none)
    graphs: dict = field(default_factory=dict)
    pool: Any = None   # the memory pool this state's graphs share; it dies with them

    def snapshot(self) -> dict[str, Tensor]:
        return {k: getattr(self, k).clone() for k in ("tok", "pos", "slot", "step", "done", "key_bias")}

    def load(self, snap: dict[str, Tensor]) -> None:
        for k, v in snap.items():
            getattr(self, k).copy_(v)


class StaticEngine(ModelEngine):
    """Static-KV-cache rollout engine; see the module docstring.

    ``cuda_graphs``: capture decode steps on CUDA (ignored on the CPU, where steps run eagerly).
    ``max_rows``: most rows (prompts x n) decoded together; more are split into batches.
    ``ignore_eos``: run every row to ``max_new_tokens`` in ``generate`` (fixed-length benchmarks).
    ``fused``: decode through the fused plan where the model allows (``engine.decoder.path`` says
    which path runs); it re-points q/k/v and gate/up weights to views of one concatenated buffer.
    ``keep_cache``: keep the KV cache and graphs between calls (fast); False frees them after each
    call, so a training step that follows has the cache's memory back (graphs are re-captured).
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, cuda_graphs: bool = True,
                 max_rows: int | None = None, length_bucket: int = 128, prompt_bucket: int = 64,
                 max_prefill_tokens: int = 16384, sync_every: int = 32,
                 stop_token_ids: Sequence[int] | None = None, add_special_tokens: bool = False,
                 ignore_eos: bool = False, keep_cache: bool = True, fused: bool = True):
        for name, value in (("length_bucket", length_bucket), ("prompt_bucket", prompt_bucket),
                            ("max_prefill_tokens", max_prefill_tokens), ("sync_every", sync_every)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(f"max_rows must be None or an int >= 1; got {max_rows!r}")
        self.model, self.tokenizer = model, tokenizer
        self.decoder = Decoder(model, fused=fused)
        self.cuda_graphs, self.max_rows = cuda_graphs, max_rows
        self.length_bucket, self.prompt_bucket = length_bucket, prompt_bucket
        self.max_prefill_tokens, self.sync_every = max_prefill_tokens, sync_every
        self.add_special_tokens, self.ignore_eos, self.keep_cache = add_special_tokens, ignore_eos, keep_cache
        pad, self.stop_token_ids = special_ids(tokenizer, self.decoder.model, stop_token_ids)
        self.pad_token_id = 0 if pad is None else pad  # generate_ids works without a tokenizer
        self._state: tuple[tuple, _State] | None = None

    @property
    def device(self) -> torch.device:
        return self.decoder.embed.weight.device

    def reset(self) -> None:
        """Drop the cache and every captured graph (after swapping parameter objects, not values)."""
        self._state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the public interface (generate: ModelEngine's, on top of generate_ids) ---------------
    def generate_ids(self, prompts: Prompts | Sequence[Sequence[int]], n: int = 1,
                     sampling: SamplingParams | None = None, ignore_eos: bool | None = None) -> Generation:
        """Token-level generation: ``Generation`` of ``len(prompts) * n`` group-contiguous rows, with
        ``rollout/prefill_seconds`` and ``rollout/decode_seconds`` in its stats. ``ignore_eos``
        (default: the engine's) runs every row to ``max_new_tokens``."""
        prompts = as_prompts(prompts, self.tokenizer, self.add_special_tokens)
        n, sampling = check_n(n), sampling or SamplingParams()
        ignore_eos = self.ignore_eos if ignore_eos is None else ignore_eos
        prompt_ids = [list(p) for p in prompts.ids]
        check_context(prompt_ids, sampling.max_new_tokens, self.model)
        per_batch = len(prompt_ids) if self.max_rows is None else max(1, self.max_rows // n)
        parts = []
        with inference(self.model), seeded(sampling.seed, self.device):
            for i in range(0, len(prompt_ids), per_batch):
                chunk = prompt_ids[i:i + per_batch]
                real = len(chunk)
                if real < per_batch < len(prompt_ids):  # pad the last batch: same shape, same graphs
                    chunk = chunk + [chunk[-1]] * (per_batch - real)
                out = self._generate_batch(chunk, n, sampling, ignore_eos)
                parts.append(out if real == len(chunk) else out.head(real * n))
        if not self.keep_cache:
            self.reset()
        return Generation.concat(parts, self.pad_token_id)

    # -- one batch ------------------------------------------------------------------------------
    def _state_for(self, rows: int, width: int, new: int) -> _State:
        key = (rows, width, new)
        if self._state is not None and self._state[0] == key:
            return self._state[1]
        self._state = None  # free the old cache (and its graphs) before allocating the new one
        dev = self.device
        stop = torch.tensor(self.stop_token_ids or [-1], dtype=torch.long, device=dev)
        st = _State(cache=self.decoder.allocate(rows, width + new, dev),
                    tok=torch.zeros(rows, dtype=torch.long, device=dev),
                    pos=torch.zeros(rows, dtype=torch.long, device=dev),
                    slot=torch.zeros(1, dtype=torch.long, device=dev),
                    step=torch.zeros(1, dtype=torch.long, device=dev),
                    done=torch.zeros(rows, dtype=torch.bool, device=dev),
                    key_bias=torch.full((rows, width + new), float("-inf"), dtype=self.decoder.dtype, device=dev),
                    out_tok=torch.zeros(rows, new, dtype=torch.long, device=dev),
                    out_lp=torch.zeros(rows, new, dtype=torch.float32, device=dev), stop=stop)
        self._state = (key, st)
        return st

    def _step(self, st: _State, length: int, sampling: SamplingParams, ignore_eos: bool) -> None:
        """One decode step on the state's buffers; every shape and Python value fixed (graph body)."""
        st.key_bias.index_fill_(1, st.slot, 0.0)
        logits = self.decoder.decode(st.tok, st.pos, st.slot, st.key_bias, st.cache, length)
        tok, lp = sample(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        tok = torch.where(st.done, self.pad_token_id, tok)
        lp = torch.where(st.done, 0.0, lp)
        st.out_tok.index_copy_(1, st.step, tok[:, None])
        st.out_lp.index_copy_(1, st.step, lp[:, None])
        if not ignore_eos:
            st.done |= (tok[:, None] == st.stop[None, :]).any(dim=1)
        st.tok.copy_(tok)
        st.pos += 1
        st.slot += 1
        st.step += 1

    def _use_graphs(self) -> bool:
        """Whether to capture graphs for this call; also routes a hooked model to the generic
        decode path, which calls every module (the fused step reads weights directly, so a hook
        such as AQN's resample="forward" would never run)."""
        hooked = _hooked_modules(self.model)
        self.decoder.use_plan = not hooked
        if not (self.cuda_graphs and self.device.type == "cuda"):
            return False
        if hooked:
            warnings.warn(f"modules with forward hooks ({hooked[:3]}...) cannot be replayed from a CUDA "
                          "graph; decoding eagerly (AQN resample='step' needs no hooks)", stacklevel=4)
            return False
        return True

    def _replay(self, st: _State, length: int, sampling: SamplingParams, ignore_eos: bool) -> None:
        key = (length, sampling.temperature, sampling.top_k, sampling.top_p, ignore_eos)
        graph = st.graphs.get(key)
        if graph is None:
            snap = st.snapshot()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: autotuning and lazy allocations happen here
                self._step(st, length, sampling, ignore_eos)
            torch.cuda.current_stream().wait_stream(side)
            st.load(snap)
            # One pool per state: a pool handle outlives its graphs, and capturing into a pool whose
            # graphs were all freed (a new state after a change of batch shape) trips an internal
            # assert of PyTorch's caching allocator (seen with torch 2.11 on an H200).
            if st.pool is None:
                st.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=st.pool):
                self._step(st, length, sampling, ignore_eos)
            st.load(snap)  # capture runs nothing, but be explicit about the state replay starts from
            st.graphs[key] = graph
        graph.replay()

    def _generate_batch(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams,
                        ignore_eos: bool) -> Generation:
        dev, dec = self.device, self.decoder
        B, new = len(prompt_ids), sampling.max_new_tokens
        longest = max(len(p) for p in prompt_ids)
        width = -(-longest // self.prompt_bucket) * self.prompt_bucket
        ids = pad_rows([torch.tensor(p, dtype=torch.long) for p in prompt_ids], self.pad_token_id, left=True)
        mask = pad_rows([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], 0, left=True)
        ids = torch.cat([ids.new_full((B, width - longest), self.pad_token_id), ids], 1).to(dev)
        mask = torch.cat([mask.new_zeros((B, width - longest)), mask], 1).to(dev)
        rows = B * n
        st = self._state_for(rows, width, new)
        t0 = time.perf_counter()
        # prefill, in chunks of whole prompts
        chunk = max(1, self.max_prefill_tokens // width)
        first_tok, first_lp = [], []
        for i in range(0, B, chunk):
            j = min(B, i + chunk)
            logits = dec.prefill(ids[i:j], mask[i:j], st.cache, slice(i * n, j * n), n)
            tok, lp = sample(logits.repeat_interleave(n, dim=0), sampling.temperature, sampling.top_k, sampling.top_p)
            first_tok.append(tok)
            first_lp.append(lp)
        tok, lp = torch.cat(first_tok), torch.cat(first_lp)
        row_mask = mask.repeat_interleave(n, dim=0)
        st.key_bias.fill_(float("-inf"))
        st.key_bias[:, :width].masked_fill_(row_mask.bool(), 0.0)
        st.out_tok.fill_(self.pad_token_id)
        st.out_lp.zero_()
        st.out_tok[:, 0], st.out_lp[:, 0] = tok, lp
        st.done.copy_(torch.zeros_like(st.done) if ignore_eos else (tok[:, None] == st.stop[None, :]).any(1))
        st.tok.copy_(tok)
        st.pos.copy_(row_mask.sum(1))
        st.slot.fill_(width)
        st.step.fill_(1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        graphs = self._use_graphs()
        steps = new
        for t in range(1, new):
            if not ignore_eos and t % self.sync_every == 0 and bool(st.done.all()):
                steps = t
                break
            length = min(width + new, -(-(width + t) // self.length_bucket) * self.length_bucket)
            if graphs:
                self._replay(st, length, sampling, ignore_eos)
            else:
                self._step(st, length, sampling, ignore_eos)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        c_ids = st.out_tok[:, :steps].clone()
        logprobs = st.out_lp[:, :steps].clone()
        if ignore_eos:
            cmask = torch.ones_like(c_ids)
            stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
        else:
            cmask, stopped = stop_mask(c_ids, self.stop_token_ids)
            width_used = int(cmask.sum(1).max())  # drop the all-padding tail after the last stop
            cmask, c_ids, logprobs = cmask[:, :width_used], c_ids[:, :width_used], logprobs[:, :width_used]
            c_ids = torch.where(cmask.bool(), c_ids, self.pad_token_id)
            logprobs = torch.where(cmask.bool(), logprobs, 0.0)
        return Generation(ids[:, width - longest:].repeat_interleave(n, 0), mask[:, width - longest:].repeat_interleave(n, 0),
                          c_ids, cmask, logprobs, stopped,
                          {"rollout/prefill_seconds": t1 - t0, "rollout/decode_seconds": t2 - t1})


# Hooks that do nothing under no_grad: transformers' and peft's enable_input_require_grads (needed
# with gradient checkpointing) mark the embedding output as requiring grad for training forwards.
_INERT_HOOKS = {"make_inputs_require_grads"}


def _hooked_modules(model: torch.nn.Module) -> list[str]:
    """Names of modules with forward (pre-)hooks that matter at inference."""
    out = []
    for name, module in model.named_modules():
        hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
        if any(getattr(h, "__name__", None) not in _INERT_HOOKS for h in hooks):
            out.append(name)
    return out
