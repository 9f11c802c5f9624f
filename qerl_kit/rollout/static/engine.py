"""``StaticEngine``: rollouts with a static KV cache, shared prefill and CUDA-graph decode steps.

A backend of ``qerl_kit.rollout``'s interface (``generate(prompts, n, sampling) -> Rollouts``,
``generate_ids`` -> ``Generation``), built for the RL loop's shape of work: the same number of
rows and completion length step after step, a policy whose LoRA weights and AQN norm noise change
in place between calls.

How one call runs:

1. Prompt ids are left-padded to a width P rounded up to ``prompt_bucket``, or to the held
   cache's wider width when that is at most ``reuse_pad`` tokens more (so calls of similar prompt
   lengths reuse one cache and its graphs), and prefilled once per unique prompt,
   in chunks of at most ``max_prefill_tokens``; keys/values are written once per prompt, to the
   cache's shared prefix that the prompt's n rows all read (``shared_prefix=False``: copied to
   each of the n rows). The first completion token of every row is sampled from the prefill's logits.
2. Each decode step (one token for every row) runs the model's own modules through ``decoder``,
   samples on the device (``sampler``), writes the token and its log-prob into output buffers and
   advances its own counters (slot, positions, step) on the device. On CUDA the step is captured
   once per attention length bucket (``length_bucket`` slots: attention reads only the part of the
   cache in use) and replayed; the host loop does nothing else but check, every ``check_every``
   steps, whether every row has stopped.
3. Rows stop at a stop token (EOS, the model's ``generation_config`` EOS ids, ``stop_token_ids``)
   or at ``max_new_tokens``; ``ignore_eos=True`` (benchmarks) runs every row to the full length.
4. Live rows only (``compact=True``): at each ``check_every`` check, when the rows still decoding fit
   in half the rows in use or fewer, they move to the front of the buffers (KV cache, tokens,
   outputs) and decoding continues on a view of the next power of two of rows, with its own
   graphs, so finished rows stop costing compute (the longest row's tail still costs a small
   batch's step time per token: bench/results/live_rows_h200.md). Greedy outputs are those of
   the uncompacted engine; sampled ones are draws of the same distribution (the RNG stream is
   consumed by fewer rows) with exact log-probs. ``rollout/row_steps`` (rows decoded, summed over
   steps) against ``rollout/dense_row_steps`` says what it saved.

What the graphs bake in, and what they read live: tensor *storage* is fixed at capture, values
are read at replay. LoRA matrices updated in place by an optimizer and AQN's in-place norm noise
are therefore live; a base weight changed in place reaches the graphs too (o/down: read live;
q/k/v and gate/up: re-copied into the fused plan's buffers at the next call). Python-level state is baked in: sampling parameters
(part of the graph key), which adapter is active, ``disable_adapter()``, module hooks. Forward
hooks (e.g. AQN's ``resample="forward"``) would not rerun at replay, so a model that has any runs
eagerly, with a warning. Replacing a parameter object (not its values) needs ``reset()``.

The model is only read: the engine's buffers (cache, fused weight copies, rotary module) are its
own, ``inference`` restores every module's train/eval flag, and AQN noise is ``sync``'s, taken out
when its block ends. The one exception is asked for by name: ``share_weights=True`` makes the
model's q/k/v and gate/up tensors row blocks of the fused plan's buffers (their values, objects,
shapes and devices unchanged; one copy of those weights in memory instead of two), and
``restore_weights()`` gives them their own storage back.

Sampling RNG: ``seed`` forks and seeds the default generators, as ``HFEngine`` does; samples
depend on seed, prompts, rows and device.
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any, Sequence

import torch
from torch import Tensor

from qerl_kit.rollout.base import ModelEngine, check_context, inference, seeded, special_ids, stop_mask
from qerl_kit.rollout.static.decoder import Decoder
from qerl_kit.rollout.static.sampler import sample
from qerl_kit.rollout.static.state import DecodeState
from qerl_kit.rollout.types import Generation, Prompts, SamplingParams, as_prompts, check_n, pad_rows

__all__ = ["StaticEngine", "DENSE_DECODE_MODES"]

DENSE_DECODE_MODES = ("auto", "on", "off")  # StaticEngine's dense_decode values


class StaticEngine(ModelEngine):
    """Static-KV-cache rollout engine; see the module docstring.

    ``cuda_graphs``: capture decode steps on CUDA (ignored on the CPU, where steps run eagerly).
    ``check_every``: decode steps between the host's checks for stopped rows (each check waits for
    the device; it is also when live rows are compacted).
    ``max_rows``: most rows (prompts x n) decoded together; more are split into batches.
    ``ignore_eos``: run every row to ``max_new_tokens`` in ``generate`` (fixed-length benchmarks).
    ``fused``: decode through the fused plan where the model allows (``engine.decoder.path`` says
    which path runs); it holds its own copy of the q/k/v and gate/up weights, concatenated.
    ``share_weights``: hold that copy only: the model's q/k/v and gate/up tensors become row blocks
    of it (``tensor.data``; values, tensor objects, shapes, dtypes and devices unchanged), which
    saves those projections' memory (about two thirds of the linear weights: 10.7 GiB for a 32B
    NVFP4 model, 2.2 GiB at 7B); the decode reads the same buffer with the same kernels. Code that
    needs each tensor on storage of its own calls ``restore_weights()``. The Trainer turns it on
    where the memory plan needs it (``rollout.share_weights``, ``qerl_kit.engine_memory``).
    ``keep_cache``: keep the KV cache and graphs between calls (fast); False frees them after each
    call, so a training step that follows has the cache's memory back (graphs are re-captured).
    ``reuse_pad``: how many tokens wider than a call's own prompt bucket the held cache may be and
    still take the call (its prompts padded to the cache's width; 0: only the same bucket). A new width
    re-allocates the cache and re-captures every graph: GSM8K's batches of 16 prompts have their
    longest prompt in the 128, 192 or 256 bucket, a different one at a third of the steps, so without
    it a run re-captures that often; the cost is attention over up to ``reuse_pad`` more masked slots.
    ``compact``: decode live rows only (step 4 of the module docstring); False runs every row until
    the longest stops (the A/B baseline).
    ``shared_prefix``: store each prompt's keys/values once for its n rows (``KVCache``'s prefix);
    False stores them in every row (the A/B baseline, and the layout ``attention="sdpa"`` needs).
    ``dense_decode``: the fused plan's dense copies of small 4-bit projection groups, decoded with
    cuBLAS where that is faster than the 4-bit kernels (``auto``: on CUDA, the rows of
    ``kernels.routes.DENSE_DECODE``: the small models' groups, a 7B's q/k/v and o; ``on``: every
    4-bit group at every row count; ``off``: none). A copy is the exact dequantization of the group's
    weights, so the policy sampled is the same; it costs that group's weights in the activation dtype
    (``memory_plan`` counts it).
    ``attention``: decode attention's implementation, ``auto`` (the split-KV Triton kernel on the
    GPU, its reference on the CPU), ``triton``, ``torch`` or ``sdpa`` (PyTorch's
    ``scaled_dot_product_attention``, the kernel's A/B baseline); see
    ``qerl_kit.kernels.decode_attention``.
    """

    batches_rows = True  # evaluate() may send every problem in one call (rows are batched and compacted here)

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, *, cuda_graphs: bool = True,
                 max_rows: int | None = None, length_bucket: int = 128, prompt_bucket: int = 64,
                 reuse_pad: int = 128, max_prefill_tokens: int = 16384, check_every: int = 32,
                 stop_token_ids: Sequence[int] | None = None, add_special_tokens: bool = False,
                 ignore_eos: bool = False, keep_cache: bool = True, fused: bool = True, compact: bool = True,
                 shared_prefix: bool = True, attention: str = "auto", dense_decode: str = "auto",
                 share_weights: bool = False, **unknown: Any):
        _check_unknown(unknown)
        for name, value in (("length_bucket", length_bucket), ("prompt_bucket", prompt_bucket),
                            ("max_prefill_tokens", max_prefill_tokens), ("check_every", check_every)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if not isinstance(reuse_pad, int) or isinstance(reuse_pad, bool) or reuse_pad < 0:
            raise ValueError(f"reuse_pad must be an int >= 0 (tokens); got {reuse_pad!r}")
        if max_rows is not None and (not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(f"max_rows must be None or an int >= 1; got {max_rows!r}")
        self.model, self.tokenizer = model, tokenizer
        if attention == "sdpa" and shared_prefix:
            raise ValueError("attention='sdpa' reads the plain cache layout: it needs shared_prefix=False")
        if dense_decode not in DENSE_DECODE_MODES:
            raise ValueError(f"dense_decode must be one of {DENSE_DECODE_MODES}; got {dense_decode!r}")
        for name, value in (("fused", fused), ("share_weights", share_weights)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False; got {value!r}")
        self.decoder = Decoder(model, fused=fused, dense_decode=dense_decode, share_weights=share_weights)
        self.decoder.set_attention(attention)
        self.shared_prefix = shared_prefix
        self.cuda_graphs, self.max_rows = cuda_graphs, max_rows
        self.length_bucket, self.prompt_bucket, self.reuse_pad = length_bucket, prompt_bucket, reuse_pad
        self.max_prefill_tokens, self.check_every = max_prefill_tokens, check_every
        self.add_special_tokens, self.ignore_eos, self.keep_cache = add_special_tokens, ignore_eos, keep_cache
        self.compact = compact
        pad, self.stop_token_ids = special_ids(tokenizer, self.decoder.model, stop_token_ids)
        self.pad_token_id = 0 if pad is None else pad  # generate_ids works without a tokenizer
        self._state: tuple[tuple, DecodeState] | None = None

    @property
    def device(self) -> torch.device:
        return self.decoder.embed.weight.device

    @property
    def shares_weights(self) -> bool:
        """Whether the model's q/k/v and gate/up tensors are row blocks of the fused plan's buffers now."""
        return self.decoder.plan is not None and self.decoder.plan.shares

    def restore_weights(self) -> None:
        """Give the model's q/k/v and gate/up tensors their own storage again (same values; the fused
        plan keeps its buffers as its own copy, so the engine decodes as before). Nothing without
        ``share_weights``."""
        self.decoder.unshare()

    def reset(self) -> None:
        """Drop the cache and every captured graph (after swapping parameter objects, not values)."""
        self._drop_state()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_state(self) -> None:
        """Free the cache and its graphs now, outside any capture (``DecodeState.release``)."""
        if self._state is not None:
            self._state[1].release()
        self._state = None

    # -- the public interface (generate: ModelEngine's, on top of generate_ids) ---------------
    def generate_ids(self, prompts: Prompts | Sequence[Sequence[int]], n: int = 1,
                     sampling: SamplingParams | None = None, ignore_eos: bool | None = None,
                     stop_after: Sequence[int] | None = None) -> Generation:
        """Token-level generation: ``Generation`` of ``len(prompts) * n`` group-contiguous rows, with
        ``rollout/prefill_seconds`` and ``rollout/decode_seconds`` in its stats. ``ignore_eos``
        (default: the engine's) runs every row to ``max_new_tokens``. ``stop_after`` (one length per
        row, benchmarks): row r ends after that many tokens, as if it had emitted a stop token there
        (stop tokens the model emits still end it earlier unless ``ignore_eos``)."""
        prompts = as_prompts(prompts, self.tokenizer, self.add_special_tokens)
        n, sampling = check_n(n), sampling or SamplingParams()
        ignore_eos = self.ignore_eos if ignore_eos is None else ignore_eos
        prompt_ids = [list(p) for p in prompts.ids]
        check_context(prompt_ids, sampling.max_new_tokens, self.model)
        if stop_after is not None:
            stop_after = [int(x) for x in stop_after]
            if len(stop_after) != len(prompt_ids) * n or min(stop_after) < 1:
                raise ValueError(f"stop_after needs one length >= 1 per row ({len(prompt_ids) * n}); got "
                                 f"{len(stop_after)} values, smallest {min(stop_after, default=None)}")
        per_batch = len(prompt_ids) if self.max_rows is None else max(1, self.max_rows // n)
        parts = []
        self.decoder.refresh()  # the fused weight copies follow the model's weights
        with inference(self.model), seeded(sampling.seed, self.device):
            for i in range(0, len(prompt_ids), per_batch):
                chunk = prompt_ids[i:i + per_batch]
                real = len(chunk)
                forced = None if stop_after is None else stop_after[i * n:(i + real) * n]  # this batch's rows
                if real < per_batch < len(prompt_ids):  # pad the last batch: same shape, same graphs
                    chunk = chunk + [chunk[-1]] * (per_batch - real)
                    forced = None if forced is None else forced + forced[-n:] * (per_batch - real)
                out = self._generate_batch(chunk, n, sampling, ignore_eos, forced)
                parts.append(out if real == len(chunk) else out.head(real * n))
        if not self.keep_cache:
            self.reset()
        return Generation.concat(parts, self.pad_token_id)

    # -- one batch ------------------------------------------------------------------------------
    def _state_for(self, rows: int, n: int, width: int, new: int) -> DecodeState:
        key = (rows, n, width, new)
        if self._state is not None and self._state[0] == key:
            return self._state[1]
        self._drop_state()  # free the old cache (and its graphs) before allocating the new one
        dev = self.device
        stop = torch.tensor(self.stop_token_ids or [-1], dtype=torch.long, device=dev)
        prompts = rows // n if self.shared_prefix else 0
        st = DecodeState(cache=self.decoder.allocate(rows, width + new, dev, prompts, width),
                    tok=torch.zeros(rows, dtype=torch.long, device=dev),
                    pos=torch.zeros(rows, dtype=torch.long, device=dev),
                    slot=torch.zeros(1, dtype=torch.long, device=dev),
                    step=torch.zeros(1, dtype=torch.long, device=dev),
                    done=torch.zeros(rows, dtype=torch.bool, device=dev),
                    key_bias=torch.full((rows, width + new), float("-inf"), dtype=self.decoder.dtype, device=dev),
                    out_tok=torch.zeros(rows, new, dtype=torch.long, device=dev),
                    out_lp=torch.zeros(rows, new, dtype=torch.float32, device=dev), stop=stop,
                    stop_at=torch.full((rows,), new + 1, dtype=torch.long, device=dev))
        self._state = (key, st)
        return st

    def _step(self, st: DecodeState, length: int, sampling: SamplingParams, ignore_eos: bool) -> None:
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
        if st.forced:  # stop_after: the row's last token is the one just written at column step
            st.done |= st.stop_at <= st.step + 1
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

    def _replay(self, st: DecodeState, length: int, sampling: SamplingParams, ignore_eos: bool) -> None:
        key = (length, sampling.temperature, sampling.top_k, sampling.top_p, ignore_eos, st.forced)
        graph = st.graphs.get(key)
        if graph is None:
            snap = st.snapshot()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: autotuning and lazy allocations happen here
                self._step(st, length, sampling, ignore_eos)
            torch.cuda.current_stream().wait_stream(side)
            st.load(snap)
            # One pool per state (its views included): a pool handle outlives its graphs, and capturing
            # into a pool whose graphs were all freed (a new state after a change of batch shape) trips
            # an internal assert of PyTorch's caching allocator (seen with torch 2.11 on an H200).
            owner = st.root or st
            if owner.pool is None:
                owner.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # No cyclic GC while capturing: a finalizer it runs (another object's CUDA graph or
            # memory) would make a CUDA call that capture forbids and invalidate this capture.
            gc_was_on = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=owner.pool):
                    self._step(st, length, sampling, ignore_eos)
            finally:
                if gc_was_on:
                    gc.enable()
            st.load(snap)  # capture runs nothing, but be explicit about the state replay starts from
            st.graphs[key] = graph
        graph.replay()

    def _generate_batch(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams,
                        ignore_eos: bool, stop_after: list[int] | None = None) -> Generation:
        """One batch: prefill, decode, and the completions cut at their stops (module docstring)."""
        B, new, rows = len(prompt_ids), sampling.max_new_tokens, len(prompt_ids) * n
        longest = max(len(p) for p in prompt_ids)
        width = self._held_width(rows, n, -(-longest // self.prompt_bucket) * self.prompt_bucket, new)
        ids, mask = self._pad_prompts(prompt_ids, longest, width)
        st = self._state_for(rows, n, width, new)
        if st.cache.prompt_row is not None:  # an earlier call's compaction moved rows
            st.cache.prompt_row.copy_(torch.arange(B, device=self.device).repeat_interleave(n))
        t0 = time.perf_counter()
        tok, lp = self._prefill(st, ids, mask, n, sampling)
        forced_len = self._start(st, tok, lp, mask, n, width, new, ignore_eos, stop_after)
        self._wait()
        t1 = time.perf_counter()
        steps, out_tok, out_lp, stats = self._decode(st, width, new, sampling, ignore_eos)
        self._wait()
        t2 = time.perf_counter()
        c_ids, cmask, logprobs, stopped = self._completions(out_tok, out_lp, steps, ignore_eos, forced_len)
        stats.update({"rollout/prefill_seconds": t1 - t0, "rollout/decode_seconds": t2 - t1,
                      "rollout/dense_row_steps": rows * (steps - 1)})
        return Generation(ids[:, width - longest:].repeat_interleave(n, 0),
                          mask[:, width - longest:].repeat_interleave(n, 0), c_ids, cmask, logprobs, stopped, stats)

    def _wait(self) -> None:
        """Wait for the device's queued work (so host timers measure it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _held_width(self, rows: int, n: int, width: int, new: int) -> int:
        """The prompt width of this call: the held cache's where it can take a call of this shape whose
        longest prompt rounds up to ``width`` (same rows, group size and new tokens; at most
        ``reuse_pad`` wider), else ``width``."""
        if self._state is None:
            return width
        held_rows, held_n, held_width, held_new = self._state[0]
        fits = (held_rows, held_n, held_new) == (rows, n, new) and width <= held_width <= width + self.reuse_pad
        return held_width if fits else width

    def _pad_prompts(self, prompt_ids: list[list[int]], longest: int, width: int) -> tuple[Tensor, Tensor]:
        """(ids [B, width], attention mask [B, width]): the prompts (the longest ``longest`` tokens)
        left-padded to ``width``, on the engine's device."""
        B = len(prompt_ids)
        ids = pad_rows([torch.tensor(p, dtype=torch.long) for p in prompt_ids], self.pad_token_id, left=True)
        mask = pad_rows([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], 0, left=True)
        ids = torch.cat([ids.new_full((B, width - longest), self.pad_token_id), ids], 1).to(self.device)
        mask = torch.cat([mask.new_zeros((B, width - longest)), mask], 1).to(self.device)
        return ids, mask

    def _prefill(self, st: DecodeState, ids: Tensor, mask: Tensor, n: int,
                 sampling: SamplingParams) -> tuple[Tensor, Tensor]:
        """Prefill in chunks of whole prompts (at most ``max_prefill_tokens``), writing the cache;
        returns every row's first token and its log-prob ([B * n] each)."""
        B, width = ids.shape
        chunk = max(1, self.max_prefill_tokens // width)
        first_tok, first_lp = [], []
        for i in range(0, B, chunk):
            j = min(B, i + chunk)
            logits = self.decoder.prefill(ids[i:j], mask[i:j], st.cache, slice(i * n, j * n), n)
            tok, lp = sample(logits.repeat_interleave(n, dim=0), sampling.temperature, sampling.top_k, sampling.top_p)
            first_tok.append(tok)
            first_lp.append(lp)
        return torch.cat(first_tok), torch.cat(first_lp)

    def _start(self, st: DecodeState, tok: Tensor, lp: Tensor, mask: Tensor, n: int, width: int, new: int,
               ignore_eos: bool, stop_after: list[int] | None) -> Tensor | None:
        """Set the state's buffers for decoding after the prefill (first token in column 0, counters
        at the first own slot); returns the forced lengths as a tensor (``stop_after``) or None."""
        row_mask = mask.repeat_interleave(n, dim=0)
        st.key_bias.fill_(float("-inf"))
        st.key_bias[:, :width].masked_fill_(row_mask.bool(), 0.0)
        st.out_tok.fill_(self.pad_token_id)
        st.out_lp.zero_()
        st.out_tok[:, 0], st.out_lp[:, 0] = tok, lp
        st.done.copy_(torch.zeros_like(st.done) if ignore_eos else (tok[:, None] == st.stop[None, :]).any(1))
        st.forced = stop_after is not None  # views take it when _compact asks for them (front)
        st.stop_at.fill_(new + 1)
        forced_len = torch.tensor(stop_after, dtype=torch.long, device=self.device) if st.forced else None
        if forced_len is not None:
            st.stop_at.copy_(forced_len)
            st.done |= st.stop_at <= 1
        st.tok.copy_(tok)
        st.pos.copy_(row_mask.sum(1))
        st.slot.fill_(width)
        st.step.fill_(1)
        return forced_len

    def _decode(self, st: DecodeState, width: int, new: int, sampling: SamplingParams,
                ignore_eos: bool) -> tuple[int, Tensor, Tensor, dict]:
        """The decode loop: a step per token (replayed from a graph or eager), every ``check_every``
        steps a check for stopped rows (all stopped: the loop ends; few live: they are compacted).
        Returns (steps run + 1, output tokens [R, C], their log-probs [R, C] in the original row
        order, stats)."""
        graphs = self._use_graphs()
        rows = st.tok.shape[0]
        steps, view, row_map, final = new, st, torch.arange(rows, device=self.device), None
        row_steps, compactions = 0, 0
        for t in range(1, new):
            if (not ignore_eos or st.forced) and t % self.check_every == 0:
                live = (~view.done).nonzero().flatten()  # the host waits here, every check_every steps
                if len(live) == 0:
                    steps = t
                    break
                target = 1 << (len(live) - 1).bit_length()  # the next power of two of the live rows
                if self.compact and target <= view.tok.shape[0] // 2:
                    view, row_map, final = self._compact(st, view, live, target, row_map, final, width + t)
                    compactions += 1
            length = min(width + new, -(-(width + t) // self.length_bucket) * self.length_bucket)
            if graphs:
                self._replay(view, length, sampling, ignore_eos)
            else:
                self._step(view, length, sampling, ignore_eos)
            row_steps += view.tok.shape[0]
        if final is None:
            return steps, st.out_tok, st.out_lp, {"rollout/row_steps": row_steps, "rollout/compactions": 0}
        final[0].index_copy_(0, row_map, view.out_tok)  # the rows still in the front go back to their places
        final[1].index_copy_(0, row_map, view.out_lp)
        return steps, final[0], final[1], {"rollout/row_steps": row_steps, "rollout/compactions": compactions}

    def _completions(self, out_tok: Tensor, out_lp: Tensor, steps: int, ignore_eos: bool,
                     forced_len: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(ids, mask, log-probs, stopped) of the completions: cut after each row's stop token (or
        forced length), padding after it, the all-padding tail dropped."""
        rows, dev = out_tok.shape[0], out_tok.device
        c_ids, logprobs = out_tok[:, :steps].clone(), out_lp[:, :steps].clone()
        if ignore_eos:
            cmask = torch.ones_like(c_ids)
            stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
        else:
            cmask, stopped = stop_mask(c_ids, self.stop_token_ids)
        if forced_len is not None:  # a forced length ends the row like a stop token would (original row order)
            forced = torch.arange(c_ids.shape[1], device=dev)[None, :] < forced_len[:, None]
            stopped = stopped | (forced_len <= c_ids.shape[1])
            cmask = cmask & forced.long() if not ignore_eos else forced.long()
        if not ignore_eos or forced_len is not None:
            width_used = max(int(cmask.sum(1).max()), 1)  # drop the all-padding tail after the last stop
            cmask, c_ids, logprobs = cmask[:, :width_used], c_ids[:, :width_used], logprobs[:, :width_used]
            c_ids = torch.where(cmask.bool(), c_ids, self.pad_token_id)
            logprobs = torch.where(cmask.bool(), logprobs, 0.0)
        return c_ids, cmask, logprobs, stopped

    @staticmethod
    def _compact(root: DecodeState, view: DecodeState, live: Tensor, rows: int, row_map: Tensor,
                 final: tuple[Tensor, Tensor] | None, filled: int) -> tuple[DecodeState, Tensor, tuple[Tensor, Tensor]]:
        """Move the ``live`` rows of ``view`` to the first ``rows`` rows of ``root``'s buffers and decode
        on the view of those from now on (its own graphs); the remaining places are filled with copies
        of a finished row, which decode nothing. Outputs of every row so far are kept in ``final`` (by
        original row) first. Only the first ``filled`` cache slots are copied (the rest is unwritten),
        and of those only the rows' own: a shared prefix stays where it is and ``prompt_row`` follows."""
        if final is None:
            final = (torch.empty_like(root.out_tok), torch.empty_like(root.out_lp))
        final[0].index_copy_(0, row_map, view.out_tok)
        final[1].index_copy_(0, row_map, view.out_lp)
        finished = view.done.nonzero().flatten()[:1]
        idx = torch.cat([live, finished.expand(rows - len(live))])
        small = root.front(rows)
        for name in ("tok", "pos", "done", "key_bias", "out_tok", "out_lp", "stop_at"):
            getattr(small, name).copy_(getattr(view, name)[idx])  # the gather copies before the write
        own = filled - root.cache.prefix_len
        for big, front in zip(view.cache.k + view.cache.v, small.cache.k + small.cache.v):
            front[:, :, :own] = big[idx, :, :own]
        if small.cache.prompt_row is not None:
            small.cache.prompt_row.copy_(view.cache.prompt_row[idx])
        return small, row_map[idx], final


# Keywords the constructor once took, with what replaced them.
_RENAMED = {"sync_every": "check_every (decode steps between the host's checks for stopped rows)"}


def _check_unknown(unknown: dict) -> None:
    """A clear error for a keyword StaticEngine does not take (a renamed one says its new name)."""
    for key in unknown:
        if key in _RENAMED:
            raise TypeError(f"StaticEngine: {key} is now called {_RENAMED[key]}; got {key}={unknown[key]!r}")
        raise TypeError(f"StaticEngine got an unexpected keyword argument {key!r}")


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
