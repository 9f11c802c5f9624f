"""The fused decode step: fewer, larger kernels per layer, on the model's own weights.

For each layer, q/k/v and gate/up become one matmul each, and each group's LoRA runs in two
launches whatever the number of adapters in it:

* **Fused base weights, no extra memory.** The q, k, v (and gate, up) projections read the same
  input, so their weights are concatenated once into one buffer and each layer's own tensors are
  re-pointed to row slices (views) of it: ``NVFP4Linear`` buffers (``packed``, ``scales``,
  ``bias``) when the group shares one global scale (``quantize_model`` makes fused groups share
  it), or ``nn.Linear`` weights for a bf16 model. The model computes exactly what it computed
  before (training, export and state dicts see the same values), and the engine runs one NVFP4
  kernel / cuBLAS call over the concatenated weight.
* **LoRA unmerged, read live.** peft's matrices are used in place: ``t = x @ [A_q; A_k; A_v]^T``,
  then ``y[:, q] += s * t[:, :r] @ B_q^T`` for every projection into the fused output, as two
  Triton launches per group (``qerl_kit.kernels.lora_triton``; the torch version was a
  concatenation, a matmul and one ``addmm`` per projection: five kernels for q/k/v). Captured
  CUDA graphs therefore never go stale when the adapter trains.
* Elementwise chains are ``qerl_kit.kernels.engine_fused`` kernels (residual add + RMSNorm, RoPE +
  cache write, SiLU x up); attention is ``qerl_kit.kernels.decode_attention`` (split-KV, the
  prompt's keys shared by its rows) with the grouped query heads laid out as
  [rows, kv_heads, group, head_dim], so K/V are never expanded.

``FusedPlan.build(decoder)`` returns None, with the reason, for what it does not cover (a LoRA
with DoRA or several active adapters, a projection that is neither ``NVFP4Linear`` nor
``nn.Linear``, an MLP activation other than SiLU); the engine then decodes with the generic path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_kit.kernels.decode_attention import decode_attention
from qerl_kit.kernels.engine_fused import add_rmsnorm, rope_to_cache, silu_mul
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
    """Projections that read one input, computed as one matmul (+ LoRA) with outputs side by side."""

    def __init__(self, modules: list[nn.Module], owner: nn.Module, tag: str):
        from qerl_kit.linear import NVFP4Linear

        pairs = [_unwrap(m) for m in modules]
        self.bases = [b for b, _ in pairs]
        self.loras = [lo for _, lo in pairs]
        self.splits = [b.out_features for b in self.bases]
        self.offsets = [sum(self.splits[:i]) for i in range(len(self.splits) + 1)]
        if all(type(b) is NVFP4Linear for b in self.bases):
            gs = self.bases[0].global_scale
            if not all(torch.equal(b.global_scale, gs) for b in self.bases):
                raise ValueError(f"{tag}: NVFP4 layers with different global scales cannot share one matmul")
            self.kind = "nvfp4"
            self.global_scale = gs
            self.packed = self._fuse(owner, tag, "packed")
            self.scales = self._fuse(owner, tag, "scales")
            self.bias = self._fuse(owner, tag, "bias") if self.bases[0].bias is not None else None
        elif all(type(b) is nn.Linear for b in self.bases):
            self.kind = "dense"
            self.weight = self._fuse(owner, tag, "weight")
            self.bias = self._fuse(owner, tag, "bias") if self.bases[0].bias is not None else None
        else:
            raise ValueError(f"{tag}: projections of type {sorted({type(b).__name__ for b in self.bases})}")
        self.lora_idx = [i for i, lo in enumerate(self.loras) if lo is not None]
        present = [self.loras[i] for i in self.lora_idx]  # the live peft tensors, read at every call
        self.lora_args = ([lo.A for lo in present], [lo.B for lo in present],
                          [self.offsets[i] for i in self.lora_idx], [lo.scale for lo in present])

    def _fuse(self, owner: nn.Module, tag: str, attr: str) -> Tensor:
        """One buffer holding every base's ``attr``, the bases re-pointed to row slices of it
        (done once per model: a second engine finds the views and reuses the buffer)."""
        key = f"_qerl_fused_{tag}_{attr}"
        parts = [getattr(b, attr) for b in self.bases]
        fused = owner.__dict__.get(key)
        if fused is not None and all(p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
                                     for p in parts):
            return fused
        if len({p.dtype for p in parts}) != 1 or len({tuple(p.shape[1:]) for p in parts}) != 1:
            raise ValueError(f"{tag}: {attr} tensors differ in dtype or width")
        fused = torch.cat([p.detach() for p in parts], dim=0)
        for b, lo, hi in zip(self.bases, self.offsets[:-1], self.offsets[1:]):
            old = getattr(b, attr)
            if isinstance(old, nn.Parameter):
                old.data = fused[lo:hi]
            else:
                setattr(b, attr, fused[lo:hi])
        owner.__dict__[key] = fused  # a plain attribute: not a buffer, not in any state dict
        return fused

    def __call__(self, x: Tensor) -> Tensor:
        if self.kind == "nvfp4":
            from qerl_kit import kernels

            y = kernels.nvfp4_linear(x, self.packed, self.scales, self.global_scale, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if self.lora_idx:
            lora_apply_(y, x, *self.lora_args)
        return y


def _eps(norm: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(norm, attr):
            return float(getattr(norm, attr))
    raise ValueError(f"{type(norm).__name__} has no epsilon attribute")


class _LayerPlan:
    def __init__(self, layer: nn.Module, index: int):
        attn, mlp = layer.self_attn, layer.mlp
        act = getattr(mlp, "act_fn", None)
        if not isinstance(act, nn.SiLU) and getattr(act, "__name__", "") != "silu" and type(act).__name__ != "SiLUActivation":
            raise ValueError(f"layer {index}: MLP activation {type(act).__name__} (the fused step does SiLU)")
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = _eps(self.ln1), _eps(self.ln2)
        self.qkv = _Group([attn.q_proj, attn.k_proj, attn.v_proj], attn, "qkv")
        self.o = _Group([attn.o_proj], attn, "o")
        self.gate_up = _Group([mlp.gate_proj, mlp.up_proj], mlp, "gate_up")
        self.down = _Group([mlp.down_proj], mlp, "down")
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)


class FusedPlan:
    """Per-layer fused groups for a ``Decoder``; ``decode`` has the same contract as its own."""

    def __init__(self, decoder):
        self.dec = decoder
        self.layers = [_LayerPlan(layer, i) for i, layer in enumerate(decoder.layers)]
        self.final_eps = _eps(decoder.norm)
        # The fused NVFP4 weights' GEMM kernels compile now (humming-kernels: 13-15 s per new shape,
        # with a progress bar), not inside the first rollout; each weight repacks at its first call.
        groups = [g for lp in self.layers for g in (lp.qkv, lp.o, lp.gate_up, lp.down) if g.kind == "nvfp4"]
        if groups and groups[0].packed.is_cuda:
            from qerl_kit import kernels

            kernels.compile_shapes({(g.packed.shape[0], g.packed.shape[1] * 2) for g in groups}, decoder.dtype,
                                   groups[0].packed.device)

    @classmethod
    def build(cls, decoder) -> tuple["FusedPlan | None", str]:
        try:
            return cls(decoder), "fused"
        except (ValueError, AttributeError) as err:
            return None, f"generic decode path ({err})"

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
