"""Which NVFP4 / NF4 / MXFP4 kernel runs where, on this machine: one call a notebook cell can make.

``kernel_report()`` says which backend the switch is on and whether each kernel family can run
here (humming-kernels, Triton, our CUDA decode kernel), with the reason when one
cannot (not installed, no GPU, an older or newer GPU). ``kernel_report(model)`` adds, for every
distinct NVFP4 (NF4, MXFP4) layer shape of the model, the kernel its forward takes at a few row counts (1 row:
one sequence decoding; 64: a GRPO group batch; 2048: a training micro-batch), read from the same
routing table the dispatcher uses (``qerl_kit.kernels.route`` on the layer's own tensors)::

    from qerl_kit.kernel_report import kernel_report
    kernel_report(model)          # a table in Jupyter, text elsewhere (print it)

A slow rollout on a GPU where humming is missing, or a model whose activations are fp16 (our CUDA
kernels take bf16), shows up here before any timing.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from qerl_kit import kernels
from qerl_kit.linear import QuantLinear

ROWS = (1, 8, 64, 256, 2048)
# Each row count allocates an (uninitialised) activation of that many rows to route: 2**20 rows is more
# tokens than any forward of a run (a micro-batch of 64 x 16k-token sequences).
ROWS_MAX = 2**20


def check_rows(rows) -> tuple[int, ...]:
    """``rows`` as a non-empty tuple of row counts, each an int in [1, 2**20] (a ConfigError naming ``rows``)."""
    from qerl_kit.config_types import ConfigError, check_value, short_repr

    allowed = f"a non-empty tuple of ints in [1, {ROWS_MAX}] (row counts, e.g. {ROWS})"
    if isinstance(rows, (str, bytes)) or not isinstance(rows, (tuple, list, range)) or len(rows) == 0:
        raise ConfigError(f"rows must be {allowed}; got {short_repr(rows)}", "rows", rows, allowed)
    return tuple(check_value(f"rows[{i}]", m, int, ge=1, le=ROWS_MAX, why="rows of activations in one forward")
                 for i, m in enumerate(rows))

@dataclass(frozen=True)
class KernelReport:
    backend: str                                   # the switch: auto, ours, triton, humming or reference
    device: str                                    # where the report's calls would run
    kernels: tuple[tuple[str, bool, str], ...]     # (family, usable here, why)
    rows: tuple[int, ...] = ()
    layers: tuple[tuple[str, int, int, tuple[str, ...]], ...] = ()   # (layer names, N, K, kernel per row count)

    def _table(self) -> tuple[list[str], list[list[str]]]:
        head = ["layers", "N x K"] + [f"{m} rows" for m in self.rows]
        return head, [[names, f"{n} x {k}", *(kernels.routes.KERNELS[p].label for p in paths)]
                      for names, n, k, paths in self.layers]

    def __str__(self) -> str:
        lines = [f"kernel backend: {self.backend}, device: {self.device}"]
        lines += [f"  {name}: {'on' if ok else 'off'} ({why})" for name, ok, why in self.kernels]
        if self.layers:
            head, body = self._table()
            widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
            for r in [head, *body]:
                lines.append("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)))
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        out = [f"<p>kernel backend: <b>{e(self.backend)}</b>, device: {e(self.device)}</p><ul>"]
        out += [f"<li>{e(name)}: <b>{'on' if ok else 'off'}</b> ({e(why)})</li>" for name, ok, why in self.kernels]
        out.append("</ul>")
        if self.layers:
            head, body = self._table()
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body]
            out.append("</table>")
        return "".join(out)


def layer_kernel(m: int, layer: QuantLinear, dtype: torch.dtype = torch.bfloat16, backend=None) -> str:
    """The kernel the forward of ``m`` rows takes through an ``NVFP4Linear``, ``NF4Linear`` or
    ``MXFP4Linear`` (a key of ``kernels.routes.KERNELS``)."""
    x = torch.empty(m, layer.in_features, device=layer.packed.device, dtype=dtype)
    return kernels.route("forward", x, layer.packed, layer.block_scales, backend, fmt=layer.fmt)


def kernel_report(model: torch.nn.Module | None = None, rows: tuple[int, ...] = ROWS,
                  dtype: torch.dtype | None = None, backend=None) -> KernelReport:
    """The backend, the kernels' status here and, with ``model``, each distinct NVFP4 / NF4 / MXFP4 layer
    shape's kernel at ``rows`` rows of ``dtype`` activations (default: the model's floating dtype;
    ``rows``: a non-empty tuple of ints in [1, 2**20], checked by ``check_rows``).
    Layers that share a shape share a row, named by their last two name parts (a peft LoRA
    wrapper's ``base_layer`` left out)."""
    rows = check_rows(rows)
    layers: dict[tuple[int, int], list[str]] = {}
    first: dict[tuple[int, int], QuantLinear] = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is not None:
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)
        for name, mod in model.named_modules():
            if isinstance(mod, QuantLinear) and mod.fmt in kernels.routes.FORMATS_ROUTED:
                key = (mod.out_features, mod.in_features)
                short = ".".join([p for p in name.split(".") if p != "base_layer"][-2:])  # under peft's LoRA too
                if short not in layers.setdefault(key, []):
                    layers[key].append(short)
                first.setdefault(key, mod)
        if first:
            device = str(next(iter(first.values())).packed.device)
    table = tuple((", ".join(names), n, k, tuple(layer_kernel(m, first[n, k], dtype, backend) for m in rows))
                  for (n, k), names in layers.items())
    return KernelReport(backend=str(backend or kernels.get_backend().value), device=device,
                        kernels=kernels.kernel_status(), rows=tuple(rows) if table else (), layers=table)
