"""A decoder forward pass over a Hugging Face model's own modules, with a static KV cache.

``Decoder(model)`` finds the pieces of a Qwen2 / Qwen3 / Llama-style causal LM (plain, quantized
or wrapped by peft) and runs them itself, so the rollout engine controls every tensor shape:

* the projections (``q/k/v/o_proj``, the MLP) are the model's modules, called as they are: an
  ``NVFP4Linear`` goes through the NVFP4 kernels, a peft LoRA wrapper adds its unmerged bf16
  low-rank path, so a new adapter (the optimizer updates it in place) needs no re-capture;
* the RMSNorms are the model's modules too, so AQN's in-place noise on their weights is read by
  every replay of a captured CUDA graph;
* rotary embeddings come from a copy of the model's ``rotary_emb`` (every RoPE variant
  transformers has; a dynamic variant updates its own buffers as lengths grow, the copy's here);
* attention is ours: ``prefill`` runs the B unique prompts through ``scaled_dot_product_attention``
  and writes their keys/values to the cache, once per prompt into a shared prefix (``KVCache``
  with ``pk``/``pv``) or once per sample row (``repeat_interleave(n)``) without one; ``decode``
  writes one token per row at cache slot ``slot`` (a device tensor, so a captured graph advances
  it itself) and attends over the first ``length`` slots with a per-row key mask, grouped-query
  style, through ``qerl_kit.kernels.decode_attention`` (split-KV Triton kernel on the GPU, its
  PyTorch reference on the CPU).

``fused=True`` (default) decodes through ``qerl_kit.rollout.static.fast.FusedPlan`` where the
model allows (fused q/k/v and gate/up matmuls, LoRA as shared down-projections, fused elementwise
kernels); ``decoder.path`` says which path runs and, if generic, why. Nothing here writes to the
model: its modules are called in eval mode under no_grad, its tensors only read; with
``share_weights=True`` the plan moves the storage of the fused projections' tensors into its own
buffers (values unchanged, ``unshare`` restores it).

Only full attention is supported (no sliding window); an unknown layout raises a clear error.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_kit.kernels.decode_attention import IMPLS, Prefix, decode_attention
from qerl_kit.rollout.static.fast import FusedPlan


@dataclass
class KVCache:
    """Static keys/values of every layer.

    ``k[layer]``, ``v[layer]`` [rows, kv_heads, S, D] hold the rows' own slots. With a shared
    prefix (``pk``/``pv`` [prompts, kv_heads, P, D], ``prompt_row`` [rows]: the prompt each row
    continues) slot j < P of row r is its prompt's position j, stored once for the prompt's n rows,
    and slot j >= P is ``k[layer][r, :, j - P]``; without one P = 0 and ``k`` holds every slot.
    """

    k: list[Tensor]
    v: list[Tensor]
    pk: list[Tensor] | None = None
    pv: list[Tensor] | None = None
    prompt_row: Tensor | None = None

    @classmethod
    def allocate(cls, layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, prompts: int = 0, prefix_len: int = 0) -> "KVCache":
        """``prompts`` > 0: a shared prefix of ``prefix_len`` slots per prompt, rows = prompts x n."""
        if prompts and (rows % prompts or not 0 < prefix_len < max_len):
            raise ValueError(f"KVCache: {rows} rows for {prompts} prompts and a prefix of {prefix_len} of "
                             f"{max_len} slots: rows must be a multiple of prompts, 0 < prefix < slots")
        own = max_len - prefix_len if prompts else max_len
        shape = (rows, kv_heads, own, head_dim)
        cache = cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                    [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])
        if prompts:
            pshape = (prompts, kv_heads, prefix_len, head_dim)
            cache.pk = [torch.zeros(pshape, dtype=dtype, device=device) for _ in range(layers)]
            cache.pv = [torch.zeros(pshape, dtype=dtype, device=device) for _ in range(layers)]
            cache.prompt_row = torch.arange(prompts, device=device).repeat_interleave(rows // prompts)
        return cache

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def prefix_len(self) -> int:
        return 0 if self.pk is None else self.pk[0].shape[2]

    @property
    def max_len(self) -> int:
        return self.prefix_len + self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + (self.pk or []) + (self.pv or []))

    def prefix(self, layer: int) -> Prefix | None:
        return None if self.pk is None else Prefix(self.pk[layer], self.pv[layer], self.prompt_row)

    def front(self, rows: int) -> "KVCache":
        """Views of the first ``rows`` rows (the prefix is shared, not sliced)."""
        return KVCache([k[:rows] for k in self.k], [v[:rows] for v in self.v], self.pk, self.pv,
                       None if self.prompt_row is None else self.prompt_row[:rows])


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [R, heads, T, D]; cos/sin [R, T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def unsupported_layout(model: nn.Module) -> str | None:
    """Why ``Decoder`` cannot run ``model`` (a sentence), or None when its layout is one it knows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, a) for a in needed) or not hasattr(base, "lm_head"):
        return (f"{type(base).__name__} is not a Qwen2/Qwen3/Llama-style causal LM (expected "
                "model.model.{embed_tokens, layers, norm, rotary_emb} and model.lm_head)")
    config = getattr(base, "config", None)
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "the static engine implements full attention only; this config enables a sliding window (use HFEngine)"
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        parts = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or not all(hasattr(attn, p) for p in parts) or not hasattr(layer, "mlp"):
            return f"layer {i} ({type(layer).__name__}) lacks self_attn.{{q,k,v,o}}_proj or mlp"
    return None


class Decoder:
    """The model's modules, run with a static KV cache (see the module docstring)."""

    def __init__(self, model: nn.Module, fused: bool = True, dense_decode: str = "auto", share_weights: bool = False):
        reason = unsupported_layout(model)
        if reason is not None:
            raise (NotImplementedError if "sliding window" in reason else TypeError)(reason)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        inner, config = base.model, base.config
        self.model, self.config = base, config
        self.embed, self.layers, self.norm = inner.embed_tokens, list(inner.layers), inner.norm
        # Our own rotary module: a dynamic RoPE (transformers' dynamic_rope_update) rewrites its
        # inv_freq buffer and length attributes as lengths grow; the model's stays untouched.
        self.rotary, self.lm_head = copy.deepcopy(inner.rotary_emb), base.lm_head
        attn = self.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attn, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        self.group = self.heads // self.kv_heads
        self.plan, self.path, self._plan_ok = None, "generic decode path (fused=False)", False
        self.use_plan = True  # the engine turns it off for a call on a model with forward hooks
        self.attention = "auto"  # decode attention's implementation (kernels.decode_attention.IMPLS)
        if fused:
            self.plan, self.path = FusedPlan.build(self, dense_decode, share_weights)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def allocate(self, rows: int, max_len: int, device: torch.device, prompts: int = 0,
                 prefix_len: int = 0) -> KVCache:
        return KVCache.allocate(self.num_layers, rows, self.kv_heads, max_len, self.head_dim,
                                self.dtype, device, prompts, prefix_len)

    def refresh(self) -> None:
        """Before a generation call: the fused plan's weight copies brought up to date (``FusedPlan.refresh``)."""
        if self.plan is not None:
            self.plan.refresh()

    def unshare(self) -> None:
        """The model's fused projections back on their own storage (``FusedPlan.unshare``); nothing
        when no plan shares it."""
        if self.plan is not None and self.plan.shares:
            self.plan.unshare()

    def set_attention(self, impl: str) -> None:
        if impl not in IMPLS:
            raise ValueError(f"attention={impl!r}; allowed: {', '.join(IMPLS)}")
        self.attention = impl

    def _qkv(self, attn: nn.Module, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h [R, T, hidden] -> q [R, H, T, D], k and v [R, KVH, T, D], rotary applied."""
        R, T, _ = h.shape
        q = attn.q_proj(h).view(R, T, self.heads, self.head_dim)
        k = attn.k_proj(h).view(R, T, self.kv_heads, self.head_dim)
        v = attn.v_proj(h).view(R, T, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary(v, positions)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _logits(self, h: Tensor) -> Tensor:
        return self.lm_head(self.norm(h)).float()

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, ids: Tensor, mask: Tensor, cache: KVCache, rows: slice, n: int) -> Tensor:
        """Run B left-padded prompts [B, P]; write their K/V to cache rows ``rows`` (B*n of them,
        each prompt's n rows contiguous) at slots [0, P), or, with a shared prefix (P its length),
        once per prompt to prefix rows ``rows // n``; return the last position's logits [B, V]."""
        B, P = ids.shape
        shared = cache.pk is not None
        if shared and P != cache.prefix_len:
            raise ValueError(f"prefill: prompts of width {P} for a shared prefix of {cache.prefix_len} slots")
        prompts = slice(rows.start // n, rows.stop // n)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        allowed = causal[None] & mask.bool()[:, None, :]
        allowed |= torch.eye(P, dtype=torch.bool, device=ids.device)[None]  # pad queries see themselves
        allowed = allowed[:, None]  # [B, 1, P, P]
        h = self.embed(ids)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, positions)
            if shared:
                cache.pk[i][prompts] = k
                cache.pv[i][prompts] = v
            else:
                cache.k[i][rows, :, :P] = k.repeat_interleave(n, dim=0)
                cache.v[i][rows, :, :P] = v.repeat_interleave(n, dim=0)
            if self.group > 1:
                k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, P, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self._logits(h[:, -1])

    # -- one decode step ------------------------------------------------------------------------
    def decode(self, tokens: Tensor, positions: Tensor, slot: Tensor, key_bias: Tensor,
               cache: KVCache, length: int) -> Tensor:
        """One new token per row: tokens/positions [R], ``slot`` a 1-element long tensor (the
        cache column written), key_bias [R, max_len] additive attention bias (0 where a key may
        be attended, -inf elsewhere; the caller opens ``slot``'s column). Attends over slots
        [0, length). Returns float32 logits [R, V]. Uses the fused plan where it applies."""
        if self.plan is not None and self.use_plan:
            if self._plan_ok:
                return self.plan.decode(tokens, positions, slot, key_bias, cache, length)
            try:  # the first fused step runs eagerly (before any graph capture): check it once
                logits = self.plan.decode(tokens, positions, slot, key_bias, cache, length)
                self._plan_ok = True
                return logits
            except Exception as err:  # noqa: BLE001 - e.g. a kernel that does not compile here
                warnings.warn(f"the fused decode step failed ({err!r:.300}); using the generic path", stacklevel=2)
                self.unshare()  # the model's tensors get their own storage back before the plan goes
                self.plan, self.path = None, f"generic decode path (fused step failed: {type(err).__name__})"
        R = tokens.shape[0]
        h = self.embed(tokens[:, None])  # [R, 1, hidden]
        pos = positions[:, None]
        own = slot - cache.prefix_len if cache.pk is not None else slot  # the column in k/v
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, pos)  # q [R, H, 1, D]; k, v [R, KVH, 1, D]
            cache.k[i].index_copy_(2, own, k)
            cache.v[i].index_copy_(2, own, v)
            qg = q.reshape(R, self.kv_heads, self.group, self.head_dim)
            o = decode_attention(qg, cache.k[i], cache.v[i], key_bias, length, self.scaling, cache.prefix(i),
                                 impl=self.attention)
            h = h + attn.o_proj(o.reshape(R, 1, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self._logits(h[:, 0])
