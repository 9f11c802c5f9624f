"""Convert every ``nn.Linear`` of a Hugging Face causal LM to a 4-bit layer, in place.

``quantize_model(model, fmt="nvfp4")`` walks the model, swaps each linear layer (except those
named in ``skip``, by default ``lm_head``) for the format's frozen layer
(``formats.FORMATS[fmt].linear``, a ``qerl_kit.linear.QuantLinear``), and returns a ``QuantReport``: layers converted, bytes before and after,
and the relative weight error ``||W - deq(q(W))|| / ||W||`` of every layer.

Fused groups share one NVFP4 global scale, as vLLM requires when it fuses q/k/v into qkv_proj
and gate/up into gate_up_proj: siblings named in ``FUSED_GROUPS`` under the same parent are
quantized with ``nvfp4.shared_global_scale`` of the group. Embeddings, norms and biases stay
in their dtype. Layers are converted one at a time, so peak memory grows by one layer at most.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from qerl_kit import nvfp4
from qerl_kit.config_types import check_names
from qerl_kit.formats import get_format
from qerl_kit.linear import NVFP4Linear, QuantLinear
from qerl_kit.table import html_table, human_bytes, text_table

DEFAULT_SKIP = ("lm_head",)  # the output head stays dense (vLLM's NVFP4 checkpoints keep it so)
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, int]
    bytes_before: int
    bytes_after: int
    rel_error: float
    fused_group: str | None = None


@dataclass
class QuantReport:
    """What ``quantize_model`` did; prints as a table and renders as HTML in a notebook."""

    fmt: str
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self.layers)

    @property
    def compression(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)

    @property
    def mean_rel_error(self) -> float:
        return sum(layer.rel_error for layer in self.layers) / max(len(self.layers), 1)

    def rows(self) -> list[dict]:
        return [{"layer": r.name, "shape": f"{r.shape[0]}x{r.shape[1]}",
                 "before": human_bytes(r.bytes_before), "after": human_bytes(r.bytes_after),
                 "rel_error": r.rel_error, "fused": r.fused_group or ""} for r in self.layers]

    def summary(self) -> str:
        return (f"{self.fmt}: {len(self.layers)} linear layers converted, "
                f"{human_bytes(self.bytes_before)} -> {human_bytes(self.bytes_after)} "
                f"({self.compression:.2f}x smaller), mean relative weight error "
                f"{self.mean_rel_error:.4f}; kept dense: {', '.join(self.skipped) or 'none'}")

    def __str__(self) -> str:
        return self.summary() + "\n" + text_table(self.rows())

    def _repr_html_(self) -> str:
        return html_table(self.rows(), caption=self.summary())


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(p == name or p in parts or name.endswith("." + p) for p in patterns)


def _linear_children(model: nn.Module, skip: tuple[str, ...]):
    """(parent, child_name, full_name, linear) for every nn.Linear to convert, plus skipped names."""
    todo, skipped = [], []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is not nn.Linear:  # exact type: leave subclasses (and ours) alone
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            (skipped if _matches(full, skip) else todo).append((parent, child_name, full, child))
    return todo, [s[2] for s in skipped]


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


def _check_layer(full: str, linear: nn.Linear, spec, tied: dict[int, str]) -> None:
    """Refuse a layer that cannot be quantized faithfully, before anything is swapped."""
    if linear.weight.is_meta:
        raise ValueError(f"layer {full!r} has no weights: it is on the meta device (built under "
                         "torch.device('meta') or init_empty_weights); load the weights first (from_pretrained, "
                         "or model.to_empty(device=...) and load_state_dict)")
    if linear.in_features % spec.block_size:
        raise ValueError(
            f"layer {full!r} has in_features={linear.in_features}, not divisible by the "
            f"{spec.name} block size {spec.block_size}; add it to skip=(...) to keep it dense")
    if id(linear.weight) in tied:
        raise ValueError(
            f"layer {full!r} shares its weight with the embedding {tied[id(linear.weight)]!r} (tied embeddings): "
            f"quantizing it would leave the embedding dense and the two untied while the model's config still "
            f"says tied. Keep it dense (skip=({full.rsplit('.', 1)[-1]!r},), the default for lm_head), or untie "
            f"it first (model.config.tie_word_embeddings = False and a separate copy of the weight)")
    if not torch.isfinite(linear.weight).all():
        raise ValueError(f"layer {full!r} has NaN or inf weights and cannot be quantized")


def _rel_error(w: torch.Tensor, deq: torch.Tensor) -> float:
    """||W - deq|| / ||W|| computed on W / max|W|, so weights of 1e-30 (whose squares underflow float32)
    and of 1e38 (whose squares overflow it) give their true, finite error."""
    w = w.detach().to(torch.float32)
    scale = w.abs().max()
    if scale == 0:
        return 0.0 if not deq.any() else float("inf")
    return ((w / scale - deq / scale).norm() / (w / scale).norm()).item()


def _group_of(parent: nn.Module, child_name: str) -> tuple[str, ...] | None:
    for group in FUSED_GROUPS:
        if child_name in group and all(isinstance(getattr(parent, g, None), nn.Linear) for g in group):
            return group
    return None


@torch.no_grad()
def quantize_model(model: nn.Module, fmt: str = "nvfp4", skip: tuple[str, ...] | None = None,
                   share_fused_scales: bool = True) -> QuantReport:
    """Swap every nn.Linear of ``model`` (except ``skip``) for a frozen ``fmt`` layer, in place.

    ``skip`` (default ``("lm_head",)``, the output head where there is one) names layers to keep dense:
    full names or name parts; a name that matches no linear layer is an error listing those there are.
    A layer tied to an embedding is refused (keep it dense or untie it first)."""
    spec = get_format(fmt)
    layer_cls = spec.linear  # the format's frozen layer (formats.FORMATS)
    skip = DEFAULT_SKIP if skip is None else check_skip(model, skip)
    todo, skipped = _linear_children(model, tuple(skip))
    if not todo:  # refused before anything changes, saying why there is nothing
        have = quantized_format(model)
        why = (f"its linear layers are already quantized ({have}, e.g. loaded from an NVFP4 checkpoint): use it as "
               "it is" if have else f"skip={tuple(skip)!r} keeps every one of them dense" if skipped else
               "it has none")
        raise ValueError(f"quantize_model found no nn.Linear layers to convert: {why}")
    report = QuantReport(fmt=spec.name, skipped=skipped)
    tied = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    for _, _, full, linear in todo:  # check everything before touching anything
        _check_layer(full, linear, spec, tied)
    # Fused groups are found (and their shared scales computed) before any layer is swapped.
    groups = [_group_of(parent, name) if share_fused_scales and spec.name == "nvfp4" else None
              for parent, name, _, _ in todo]
    shared = {(id(parent), group): nvfp4.shared_global_scale(*(getattr(parent, g).weight for g in group))
              for (parent, _, _, _), group in zip(todo, groups) if group is not None}
    for (parent, child_name, full, linear), group in zip(todo, groups):
        kwargs = {} if group is None else {"global_scale": shared[(id(parent), group)]}
        try:
            qlayer = layer_cls.from_linear(linear, **kwargs)
        except (ValueError, TypeError) as err:
            raise ValueError(f"cannot convert layer {full!r} to {spec.name}: {err}") from err
        err = _rel_error(linear.weight, qlayer.dequantized_weight(torch.float32))
        report.layers.append(LayerReport(
            name=full, shape=tuple(linear.weight.shape),
            bytes_before=linear.weight.numel() * linear.weight.element_size(),
            bytes_after=sum(getattr(qlayer, f).numel() * getattr(qlayer, f).element_size()
                            for f in layer_cls._tensor_fields),
            rel_error=err, fused_group="/".join(group) if group else None))
        setattr(parent, child_name, qlayer)
    if hasattr(model, "config"):
        model.config.qerl_quantization = {"format": spec.name, "skip": list(skip)}
    return report


def check_skip(model: nn.Module, skip) -> tuple[str, ...]:
    """``skip`` as a tuple; each name must name a linear layer of ``model`` (a typo would quantize
    the layer it meant silently): a ConfigError lists the names there are."""
    names = _linear_names(model)
    return tuple(check_names("skip", skip, names, lambda p, full: _matches(full, (p,)), what="linear layer",
                             shown=sorted({n.rsplit(".", 1)[-1] for n in names})))


def quantized_head(model: nn.Module, skip: tuple[str, ...]) -> str | None:
    """The output head's name when ``skip`` leaves it (a dense nn.Linear) to be quantized, else None:
    an export keeps it dense (vLLM does), and a head tied to the embedding cannot be quantized."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return None
    name = next((n for n, m in model.named_modules() if m is head), None)
    return name if name and not _matches(name, tuple(skip)) else None


def quantized_format(model: nn.Module) -> str | None:
    """The format of the quantized layers ``model`` already holds (``load_nvfp4`` and ``load_pretrained``
    of an NVFP4 export give NVFP4 layers), or None for a dense model."""
    return next((m.fmt for m in model.modules() if isinstance(m, QuantLinear)), None)


@dataclass
class MemoryReport:
    """Bytes of a model's tensors by kind: packed 4-bit codes, quantization scales, dense rest."""

    packed: int
    scales: int
    dense: int
    dense_by_dtype: dict[str, int]

    @property
    def total(self) -> int:
        return self.packed + self.scales + self.dense

    def rows(self) -> list[dict]:
        rows = [{"kind": "packed 4-bit codes", "bytes": human_bytes(self.packed)},
                {"kind": "quantization scales", "bytes": human_bytes(self.scales)}]
        rows += [{"kind": f"dense ({dt})", "bytes": human_bytes(n)} for dt, n in self.dense_by_dtype.items()]
        rows.append({"kind": "total", "bytes": human_bytes(self.total)})
        return rows

    def __str__(self) -> str:
        return text_table(self.rows())

    def _repr_html_(self) -> str:
        return html_table(self.rows(), caption="model memory by kind")


def memory_report(model: nn.Module) -> MemoryReport:
    """Bytes by kind: packed codes and scales of quantized layers, everything else as dense."""
    packed = scales = 0
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, QuantLinear):
            for name in module._tensor_fields:
                t = getattr(module, name)
                seen.add(id(t))
                size = t.numel() * t.element_size()
                if name == "packed":
                    packed += size
                else:
                    scales += size
    dense_by_dtype: dict[str, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))  # tied weights count once
        key = str(t.dtype).replace("torch.", "")
        dense_by_dtype[key] = dense_by_dtype.get(key, 0) + t.numel() * t.element_size()
    return MemoryReport(packed, scales, sum(dense_by_dtype.values()), dense_by_dtype)


def nvfp4_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (N, K) weight shapes of a model's NVFP4 layers."""
    return sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, NVFP4Linear)})


def prepare_kernels(model: nn.Module, dtype: torch.dtype | None = None, extra_shapes=(),
                    progress: bool = True) -> dict[tuple[int, int], float]:
    """Compile the NVFP4 GPU kernels (humming-kernels) for every NVFP4 layer shape of a model on a
    GPU, and ``extra_shapes`` (a rollout engine's fused q/k/v and gate/up), now and with a progress
    bar, instead of 13-15 s at the first call of each shape: {(N, K): seconds}. Shapes already in
    humming's disk cache take milliseconds; {} when the model is not on a GPU or humming is not
    usable (``qerl_kit.kernels.kernel_status()`` says why)."""
    from qerl_kit import kernels

    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
    device = next((b.device for b in model.buffers() if b.is_cuda), None)
    if device is None or dtype not in (torch.bfloat16, torch.float16):
        return {}
    return kernels.compile_shapes(nvfp4_shapes(model) + list(extra_shapes), dtype, device, progress)
