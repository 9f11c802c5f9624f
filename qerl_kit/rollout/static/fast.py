"""The fused decode step: fewer, larger kernels per layer, reading the model's weights.

For each layer, q/k/v and gate/up become one matmul each, and each group's LoRA runs in two
launches whatever the number of adapters in it:

* **Fused base weights, in the plan's own buffers.** The q, k, v (and gate, up) projections read
  the same input, so their weights are copied once into one buffer per group: ``NVFP4Linear``
  buffers (``packed``, ``scales``, ``bias``) when the group shares one global scale
  (``quantize_model`` makes fused groups share it), or ``nn.Linear`` weights for a bf16 model; the
  engine runs one NVFP4 kernel / cuBLAS call over the concatenated weight. By default the model is
  never written to: its tensors keep their storage, values and attributes, and the copy costs the
  memory of those projections (about two thirds of a transformer's linear weights: 10.7 GiB at 32B
  NVFP4; ``fused=False`` has none). ``share=True`` (the engine's ``share_weights``) holds one copy
  instead of two: each of the model's tensors becomes a row block of the buffer (``tensor.data =
  buffer[rows]``: the same tensor objects, values, shapes, dtypes and devices; only their storage
  moves), and ``unshare()`` gives each its own storage again (``restore_weights``). Parts that
  already are consecutive row blocks of one buffer (the model after a sharing plan) are decoded
  from that buffer without a copy. ``FusedPlan.refresh()``, at the start of every generation call,
  re-copies a projection whose tensor changed (trained, reloaded or replaced: its version counter
  or storage moved), so the plan decodes the model as it is now; a sharing plan then makes the
  replaced tensor a row block again. o_proj and down_proj are single projections: their own
  tensors are used.
* **LoRA unmerged, read live.** peft's matrices are used in place: ``t = x @ [A_q; A_k; A_v]^T``,
  then ``y[:, q] += s * t[:, :r] @ B_q^T`` for every projection into the fused output, as two
  Triton launches per group (``qerl_kit.kernels.lora_triton``; the torch version was a
  concatenation, a matmul and one ``addmm`` per projection: five kernels for q/k/v). Captured
  CUDA graphs therefore never go stale when the adapter trains.
* **Dense copies of small groups.** Where ``kernels.routes.DENSE_DECODE`` says cuBLAS on a dense
  weight beats the 4-bit kernels (the small models' widths from 5 rows, the 7B's q/k/v and o from
  64; ``dense_decode="auto"`` on CUDA), the group also holds its weights dequantized (exactly) and
  decodes them with ``F.linear`` at those rows; ``refresh`` re-makes the copy in place when a base
  tensor changed.
* Elementwise chains are ``qerl_kit.rollout.static.fused`` kernels (residual add + RMSNorm, RoPE +
  cache write, SiLU x up); attention is ``qerl_kit.kernels.decode_attention`` (split-KV, the
  prompt's keys shared by its rows) with the grouped query heads laid out as
  [rows, kv_heads, group, head_dim], so K/V are never expanded.

``FusedPlan.build(decoder)`` returns None, with the reason, for what it does not cover (a LoRA
with DoRA or several active adapters, a projection that is none of ``NVFP4Linear``, ``NF4Linear``,
``MXFP4Linear`` (their codes and block scales concatenate as NVFP4's do; ``kernels.lut4_linear``
runs the group) and ``nn.Linear``, an MLP activation other than SiLU); the engine then decodes with
the generic path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_kit.kernels import routes
from qerl_kit.kernels.decode_attention import decode_attention
from qerl_kit.rollout.static.fused import add_rmsnorm, rope_to_cache, silu_mul
from qerl_kit.kernels.lora_triton import lora_apply_


@dataclass
class _Lora:
    A: Tensor      # [r, in]  (a live peft parameter)
    B: Tensor      # [out, r]
    scale: float


def _unwrap(module: nn.Module) -> tuple[nn.Module, _Lora | None]:
    """(base layer, its single active LoRA or None); raises ValueError for what is not covered."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        LoraLayer = ()  # noqa: N806
    if not isinstance(module, LoraLayer):
        return module, None
    if module.merged:
        raise ValueError("a merged LoRA layer")
    if module.disable_adapters:
        return module.get_base_layer(), None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) > 1:
        raise ValueError(f"{len(active)} active adapters")
    if not active:
        return module.get_base_layer(), None
    name = active[0]
    if getattr(module, "use_dora", {}).get(name, False):
        raise ValueError("DoRA")
    A, B = module.lora_A[name], module.lora_B[name]
    if getattr(A, "bias", None) is not None or getattr(B, "bias", None) is not None:
        raise ValueError("a LoRA bias")
    return module.get_base_layer(), _Lora(A.weight, B.weight, float(module.scaling[name]))


class _Group:
    """Projections that read one input, computed as one matmul (+ LoRA) with outputs side by side.

    With several projections the base weights are copied into one buffer the group owns
    (``refresh`` re-copies a part whose tensor changed); a single projection's tensors are used as
    they are. The model's own tensors are only read, unless ``share``: then they become row blocks
    of the buffer (their values unchanged) until ``unshare``."""

    def __init__(self, modules: list[nn.Module], tag: str, dense: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 share: bool = False):
        from qerl_kit.linear import MXFP4Linear, NF4Linear, NVFP4Linear

        pairs = [_unwrap(m) for m in modules]
        self.tag, self.share = tag, share
        self.bases = [b for b, _ in pairs]
        self.loras = [lo for _, lo in pairs]
        self.splits = [b.out_features for b in self.bases]
        self.offsets = [sum(self.splits[:i]) for i in range(len(self.splits) + 1)]
        if all(type(b) is NVFP4Linear for b in self.bases):
            gs = self.bases[0].global_scale
            if not all(torch.equal(b.global_scale, gs) for b in self.bases):
                raise ValueError(f"{tag}: NVFP4 layers with different global scales cannot share one matmul")
            self.kind, self.global_scale = "nvfp4", gs
            self.attrs = ("packed", "scales") + (("bias",) if self.bases[0].bias is not None else ())
        elif len({type(b) for b in self.bases}) == 1 and type(self.bases[0]) in (NF4Linear, MXFP4Linear):
            # No per-tensor scale: the codes and block scales concatenate row-wise as they are.
            self.kind = self.bases[0].fmt
            scales = self.bases[0]._tensor_fields[1]  # NF4's absmax, MXFP4's scales
            self.attrs = ("packed", scales) + (("bias",) if self.bases[0].bias is not None else ())
        elif all(type(b) is nn.Linear for b in self.bases):
            self.kind = "dense"
            self.attrs = ("weight",) + (("bias",) if self.bases[0].bias is not None else ())
        else:
            raise ValueError(f"{tag}: projections of type {sorted({type(b).__name__ for b in self.bases})}")
        self.fused: dict[str, Tensor] = {}
        self._seen: dict[str, tuple] = {}
        for attr in self.attrs:
            self.fused[attr] = self._concat(attr)
        self.lora_idx = [i for i, lo in enumerate(self.loras) if lo is not None]
        present = [self.loras[i] for i in self.lora_idx]  # the live peft tensors, read at every call
        self.lora_args = ([lo.A for lo in present], [lo.B for lo in present],
                          [self.offsets[i] for i in self.lora_idx], [lo.scale for lo in present])
        self._hold_dense(dense, dtype)

    def _hold_dense(self, dense: str, dtype: torch.dtype) -> None:
        """A dense copy of a 4-bit group where decoding on it is faster (``dense="auto"``: on CUDA, the
        rows of ``kernels.routes.DENSE_DECODE``; ``"on"``: at every row count, ``"off"``: never)."""
        self.dense_weight, self.dense_all = None, dense == "on"
        if self.kind not in ("nvfp4", "nf4", "mxfp4") or dense == "off":
            return
        n, k = self.offsets[-1], self.bases[0].in_features
        if self.dense_all or (self.packed.is_cuda and routes.dense_decode_held(n, k, self.kind)):
            self.dense_dtype, self._dense_seen = dtype, self._dense_stamp()
            self.dense_weight = self._dequantized()

    def _dequantized(self) -> Tensor:
        """The group's weights dequantized (exactly: ``QuantLinear.dequantized_weight``), side by side."""
        with torch.no_grad():
            return torch.cat([b.dequantized_weight(self.dense_dtype) for b in self.bases], dim=0)

    def _dense_stamp(self) -> tuple:
        """``_stamp`` of every 4-bit tensor the dense copy is made from."""
        return self._stamp([getattr(b, name) for b in self.bases for name in b._tensor_fields])

    def _uses_dense(self, rows: int) -> bool:
        if self.dense_weight is None:
            return False
        return self.dense_all or routes.dense_decode(rows, self.offsets[-1], self.bases[0].in_features, self.kind,
                                                     self.dense_dtype)

    @property
    def packed(self) -> Tensor:
        return self.fused["packed"]

    @property
    def scales(self) -> Tensor:
        return self.fused[self.attrs[1]]  # NVFP4's / MXFP4's scales, NF4's absmax

    @property
    def weight(self) -> Tensor:
        return self.fused["weight"]

    @property
    def bias(self) -> Tensor | None:
        return self.fused.get("bias")

    def _parts(self, attr: str) -> list[Tensor]:
        return [getattr(b, attr) for b in self.bases]

    @staticmethod
    def _stamp(parts: list[Tensor]) -> tuple:
        """What identifies the parts' current values: the tensor objects, their storage and their
        version counters (an in-place write, an optimizer step or ``load_state_dict``, bumps it)."""
        return tuple((id(p), p.data_ptr(), p._version) for p in parts)

    def _concat(self, attr: str) -> Tensor:
        """The group's buffer for ``attr``: the model's tensor itself for one projection, the buffer
        the parts already are row blocks of, else a copy of every projection's tensor, row blocks side
        by side (with ``share``, the parts then become those row blocks)."""
        parts = self._parts(attr)
        if len(parts) == 1:
            return parts[0]
        if len({p.dtype for p in parts}) != 1 or len({tuple(p.shape[1:]) for p in parts}) != 1:
            raise ValueError(f"{self.tag}: {attr} tensors differ in dtype or width")
        fused = _tiled(parts)
        if fused is None:
            with torch.no_grad():
                fused = torch.cat([p.detach() for p in parts], dim=0)
            if self.share:
                for part, lo, hi in zip(parts, self.offsets[:-1], self.offsets[1:]):
                    part.data = fused[lo:hi]  # the same tensor object and values; its old storage is freed
        self._seen[attr] = self._stamp(parts)
        return fused

    def unshare(self) -> None:
        """Give every model tensor that is a row block of this group's buffers its own storage again
        (a copy of the same values); the buffers stay the plan's own copy."""
        self.share = False
        for attr in self.attrs:
            parts = self._parts(attr)
            if len(parts) == 1:
                continue
            buffer = self.fused[attr].untyped_storage().data_ptr()
            with torch.no_grad():
                for part in parts:
                    if part.untyped_storage().data_ptr() == buffer:
                        part.data = part.detach().clone()
            self._seen[attr] = self._stamp(parts)

    def refresh(self) -> None:
        """Copy into the group's buffers the parts that changed since the last copy (a base weight
        trained, reloaded or replaced); nothing when none did, so kernels that cache a repacked
        weight by the buffer's version (humming) keep it."""
        for attr in self.attrs:
            parts = self._parts(attr)
            if len(parts) == 1:
                if parts[0] is not self.fused[attr]:  # a replaced tensor (its values: read live otherwise)
                    self.fused[attr] = parts[0]
                continue
            stamp = self._stamp(parts)
            if stamp == self._seen[attr]:
                continue
            with torch.no_grad():
                for part, lo, hi, new, old in zip(parts, self.offsets[:-1], self.offsets[1:], stamp, self._seen[attr]):
                    if new != old:
                        # A part that is this row block already was written in place: the copy is a no-op
                        # that moves the buffer's version on, so kernels caching it by version (humming) rebuild.
                        block = self.fused[attr][lo:hi]
                        block.copy_(part.detach())
                        if self.share and part.data_ptr() != block.data_ptr() and _same_kind(part, block):
                            part.data = block  # shared again (a tensor moved to another device or dtype: not)
            self._seen[attr] = self._stamp(parts)  # after the copies: a view's counter may be the buffer's
        if self.dense_weight is not None and (stamp := self._dense_stamp()) != self._dense_seen:
            self.dense_weight.copy_(self._dequantized())  # in place: captured graphs read this buffer
            self._dense_seen = stamp

    def __call__(self, x: Tensor) -> Tensor:
        if self._uses_dense(x.shape[0]):  # decided per row count, so once per captured graph
            bias = self.bias
            y = F.linear(x, self.dense_weight, None if bias is None else bias.to(x.dtype))
        elif self.kind == "nvfp4":
            from qerl_kit import kernels

            y = kernels.nvfp4_linear(x, self.packed, self.scales, self.global_scale, self.bias)
        elif self.kind in ("nf4", "mxfp4"):
            from qerl_kit import kernels

            y = kernels.lut4_linear(x, self.packed, self.scales, self.kind, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora_idx:
            lora_apply_(y, x, *self.lora_args)
        return y


def _same_kind(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` can stand for ``a`` as its storage: the same shape, dtype and device."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _tiled(parts: list[Tensor]) -> Tensor | None:
    """The tensor of which ``parts`` are consecutive row blocks, in order (a model whose tensors a
    sharing plan made row blocks of its buffer, or a loader that split one fused weight), or None."""
    first, row = parts[0], math.prod(parts[0].shape[1:])
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.device != first.device or p.untyped_storage().data_ptr() != storage
                or p.storage_offset() != offset):
            return None
        offset += p.shape[0] * row
    rows = sum(p.shape[0] for p in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _eps(norm: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(norm, attr):
            return float(getattr(norm, attr))
    raise ValueError(f"{type(norm).__name__} has no epsilon attribute")


class _LayerPlan:
    def __init__(self, layer: nn.Module, index: int, dense: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 share: bool = False):
        attn, mlp = layer.self_attn, layer.mlp
        act = getattr(mlp, "act_fn", None)
        if not isinstance(act, nn.SiLU) and getattr(act, "__name__", "") != "silu" and type(act).__name__ != "SiLUActivation":
            raise ValueError(f"layer {index}: MLP activation {type(act).__name__} (the fused step does SiLU)")
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = _eps(self.ln1), _eps(self.ln2)
        self.qkv = _Group([attn.q_proj, attn.k_proj, attn.v_proj], "qkv", dense, dtype, share)
        self.o = _Group([attn.o_proj], "o", dense, dtype)
        self.gate_up = _Group([mlp.gate_proj, mlp.up_proj], "gate_up", dense, dtype, share)
        self.down = _Group([mlp.down_proj], "down", dense, dtype)
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)

    @property
    def groups(self) -> tuple[_Group, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class FusedPlan:
    """Per-layer fused groups for a ``Decoder``; ``decode`` has the same contract as its own.
    ``share``: the model's q/k/v and gate/up tensors become row blocks of the plan's buffers (the
    module docstring), layer by layer as the plan is built, so memory never holds both copies."""

    def __init__(self, decoder, dense: str = "auto", share: bool = False):
        self.dec = decoder
        self.layers = [_LayerPlan(layer, i, dense, decoder.dtype, share) for i, layer in enumerate(decoder.layers)]
        self.final_eps = _eps(decoder.norm)
        # The fused NVFP4 weights' GEMM kernels compile now (humming-kernels: 13-15 s per new shape,
        # with a progress bar), not inside the first rollout; each weight repacks at its first call.
        groups = [g for lp in self.layers for g in lp.groups if g.kind == "nvfp4"]
        if groups and groups[0].packed.is_cuda:
            from qerl_kit import kernels

            kernels.compile_shapes({(g.packed.shape[0], g.packed.shape[1] * 2) for g in groups}, decoder.dtype,
                                   groups[0].packed.device)

    @classmethod
    def build(cls, decoder, dense: str = "auto", share: bool = False) -> tuple["FusedPlan | None", str]:
        """(plan, "fused"), or (None, why) for a model the plan does not cover. A sharing plan that
        fails part way leaves the layers it passed sharing a buffer no plan holds: same values, one copy."""
        try:
            return cls(decoder, dense, share), "fused"
        except (ValueError, AttributeError) as err:
            return None, f"generic decode path ({err})"

    @property
    def shares(self) -> bool:
        """Whether the model's fused projections are row blocks of this plan's buffers."""
        return any(g.share for lp in self.layers for g in (lp.qkv, lp.gate_up))

    def unshare(self) -> None:
        """Every model tensor back on its own storage (same values); the plan keeps its buffers as copies."""
        for lp in self.layers:
            lp.qkv.unshare()
            lp.gate_up.unshare()

    def refresh(self) -> None:
        """Bring the concatenated weights up to date with the model's (``_Group.refresh``); the
        engine calls it at the start of every generation call."""
        for lp in self.layers:
            for group in lp.groups:
                group.refresh()

    def decode(self, tokens: Tensor, positions: Tensor, slot: Tensor, key_bias: Tensor, cache, length: int) -> Tensor:
        dec = self.dec
        R, H, KVH, D = tokens.shape[0], dec.heads, dec.kv_heads, dec.head_dim
        nq, nk = H * D, KVH * D
        x = dec.embed(tokens)  # [R, hidden]
        cos, sin = dec.rotary(x[:, None], positions[:, None])
        cos, sin = cos[:, 0], sin[:, 0]
        P = cache.prefix_len  # slot >= P: the rows' own cache columns start at P
        h = None
        pending = x  # what the next add_rmsnorm adds to the residual stream
        for i, lp in enumerate(self.layers):
            xn, h = add_rmsnorm(pending, h, dec.layers[i].input_layernorm.weight, lp.eps1)
            qkv = lp.qkv(xn)
            q = qkv[:, :nq].view(R, H, D)
            k = qkv[:, nq:nq + nk].view(R, KVH, D)
            v = qkv[:, nq + nk:].view(R, KVH, D)
            if lp.q_norm is not None:
                q, k = lp.q_norm(q), lp.k_norm(k)
            q = rope_to_cache(q, k, v, cos, sin, cache.k[i], cache.v[i], slot, offset=P)
            o = decode_attention(q.view(R, KVH, H // KVH, D), cache.k[i], cache.v[i], key_bias, length,
                                 dec.scaling, cache.prefix(i), impl=dec.attention)
            o = lp.o(o.reshape(R, nq))
            xn, h = add_rmsnorm(o, h, dec.layers[i].post_attention_layernorm.weight, lp.eps2)
            pending = lp.down(silu_mul(lp.gate_up(xn)))
        xn, _ = add_rmsnorm(pending, h, dec.norm.weight, self.final_eps)
        return dec.lm_head(xn).float()
