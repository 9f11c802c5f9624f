"""Non-finite values stopped where they appear, with an error that names them.

One NaN or inf weight, reward, logit, loss or gradient otherwise travels on silently: a NaN base
model decodes empty completions that score 0, an inf reward zeroes its group's advantages, a NaN
gradient turns the adapter into NaN for good. Every entry point checks with the functions here:

* ``check_weights(model, source)``: after a model is loaded (``models.load_model`` and
  ``load_pretrained``, every ``--format``, ``none`` included) and before a checkpoint is written;
  names the first non-finite tensor and where it came from; every dtype a loaded model holds (float8
  NVFP4 scales are checked as floats, packed integer codes hold no NaN). ``check_tensor``: the same
  for one tensor as it is read (``export.load_nvfp4``: names the tensor and its safetensors file).
* ``check_logprobs`` / ``logits_error``: after a rollout, and when sampling itself fails, the
  policy's logits at the first non-finite decode step, with the weights' state (the first
  non-finite parameter, or the largest |w|, where, and the LoRA scale lora_alpha / r) instead of
  torch's "probability tensor contains either inf, nan or element < 0". With finite weights the
  message lists the likely causes and asserts none (a huge lora_alpha overflows as surely as a
  diverged adapter).
* ``check_loss`` and ``GradGuard``: the trainer's loss (an error naming the step and the non-finite
  input, or, when every input is finite, the likely causes of the overflow) and gradient
  norm (a step with a non-finite gradient is skipped with a warning naming the first such
  parameter, as verl does; ``GradGuard.max_in_a_row`` such updates in a row are an error).

Reward scores are checked where they enter (``qerl_kit.scoring.checked_scores``) with
``finite_score``.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable

import torch

from qerl_kit.config_types import short_repr

__all__ = ["NonFiniteError", "first_nonfinite", "check_weights", "check_tensor", "weights_state", "lora_scale", "logits_error", "LOSS_INPUTS",
           "check_logprobs", "check_loss", "GradGuard", "finite_score"]

_CHUNK = 1 << 24  # elements per isfinite pass: bounds the temporary bool tensor on a large embedding


class NonFiniteError(ValueError):
    """A weight, score, logit, loss or gradient that must be finite is NaN or inf (or too large)."""


def _checkable(c: torch.Tensor) -> torch.Tensor:
    """``c`` in a dtype torch's isfinite/isnan support: float8 (NVFP4 block scales) as float32, which
    keeps a NaN a NaN."""
    return c.float() if c.is_floating_point() and c.element_size() == 1 else c


def _all_finite(t: torch.Tensor) -> bool:
    if not (t.is_floating_point() or t.is_complex()):
        return True  # integer / packed 4-bit codes hold no NaN
    flat = t.detach().reshape(-1)
    return all(bool(torch.isfinite(_checkable(c)).all()) for c in flat.split(_CHUNK)) if flat.numel() else True


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    """The first (name, tensor) holding a NaN or inf, or None."""
    for name, t in named:
        if t is not None and not _all_finite(t):
            return name, t
    return None


def _count(t: torch.Tensor) -> str:
    t = _checkable(t.detach())
    nan, total = int(torch.isnan(t).sum()), t.numel()
    inf = int(torch.isinf(t).sum())
    return f"{nan} NaN and {inf} inf of {total} values"


def _tensors(model: torch.nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def check_weights(model: torch.nn.Module, source, what: str = "model", trainable_only: bool = False,
                  then: str = "corrupt, or from a diverged run; nothing was run with it") -> None:
    """Raise ``NonFiniteError`` naming the first parameter or buffer of ``model`` (only the
    trainable parameters with ``trainable_only``) with a NaN/inf, and ``source`` (the file,
    directory or checkpoint it came from or goes to)."""
    named = ((n, p) for n, p in model.named_parameters() if p.requires_grad) if trainable_only else _tensors(model)
    bad = first_nonfinite(named)
    if bad is not None:
        name, t = bad
        raise NonFiniteError(f"{what} {short_repr(str(source), 200)}: weight {name!r} is not finite ({_count(t)}); "
                             f"{then}")


def check_tensor(name: str, t: torch.Tensor, source, what: str = "checkpoint") -> torch.Tensor:
    """``t``, or ``NonFiniteError`` naming tensor ``name`` and ``source`` (the file it was read from)
    when it holds a NaN/inf: what ``check_weights`` says of a model, for one tensor as it is read."""
    if not _all_finite(t):
        raise NonFiniteError(f"{what} {short_repr(str(source), 200)}: tensor {name!r} is not finite ({_count(t)}); "
                             "the file is corrupt, or from a diverged run; nothing was run with it")
    return t


def lora_scale(model: torch.nn.Module) -> float | None:
    """The largest LoRA scale (lora_alpha / r) of a peft model's LoRA layers, or None without any."""
    scales = [abs(float(v)) for m in model.modules()
              if isinstance(getattr(m, "scaling", None), dict) and hasattr(m, "lora_A") for v in m.scaling.values()]
    if not scales:
        return None
    return next((v for v in scales if not math.isfinite(v)), max(scales))  # a NaN scale first


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _scale_text(model: torch.nn.Module) -> str:
    scale = lora_scale(model)
    if scale is None:
        return ""
    text = f"; the LoRA scale lora_alpha / r is {scale:.3g}"
    return text + (" (beyond float32's range: it overflows by itself)" if not scale <= _FLOAT32_MAX else "")


def weights_state(model: torch.nn.Module) -> str:
    """The weights' state for a diagnosis: the first non-finite parameter, else the largest |w| and
    where (and the LoRA scale lora_alpha / r of a peft model)."""
    named = list(model.named_parameters())
    bad = first_nonfinite(named)
    if bad is not None:
        return f"parameter {bad[0]!r} is not finite ({_count(bad[1])})"
    top_name, top = None, 0.0
    for name, p in named:
        if p.is_floating_point() and p.numel():
            m = float(p.detach().abs().max())
            if m > top:
                top_name, top = name, m
    return f"every parameter is finite; the largest is max |w| = {top:.3g} in {top_name!r}{_scale_text(model)}"


def _weights_finite(model: torch.nn.Module) -> bool:
    return first_nonfinite(model.named_parameters()) is None


def logits_error(model: torch.nn.Module, step: int | None) -> NonFiniteError:
    """The error for non-finite logits at decode ``step`` (0 = the first new token). With a non-finite
    weight, that weight is the cause; with finite weights the likely causes are listed, none asserted."""
    where = "" if step is None else f" at decode step {step}"
    if _weights_finite(model):
        why = ("Likely causes (none certain): an adapter scale (model.lora_alpha / r) or adapter/base weights "
               "large enough to overflow the forward pass, e.g. an adapter diverged under too high an optim.lr, "
               "or a checkpoint with extreme values")
    else:
        why = ("Check the adapter/base weights: an adapter diverged (lower optim.lr), or a corrupt checkpoint")
    return NonFiniteError(
        f"the policy's logits are non-finite (nan/inf){where}, so no token can be sampled; {weights_state(model)}. "
        + why)


def check_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, model: torch.nn.Module | None) -> None:
    """After a rollout: every sampled token's log-prob must be finite (one reduction); a NaN there
    means the logits it was drawn from were not (a greedy or Gumbel argmax does not fail on NaN)."""
    bad = ~torch.isfinite(logprobs) & mask.bool()
    if bool(bad.any()):
        step = int(bad.any(dim=0).int().argmax())
        if model is None:
            raise NonFiniteError(f"the policy's logits are non-finite (nan/inf) at decode step {step}; check the "
                                 "adapter/base weights")
        raise logits_error(model, step)


# What the trainer's loss is computed from, in the order ``check_loss``'s ``inputs`` gives them.
LOSS_INPUTS = ("log-probs", "old log-probs", "advantages", "reference log-probs", "importance weights")


def _rows(rows) -> str:
    """A micro-batch's rows as an error names them: ``a:b`` for a slice, else the row numbers (the first 8)."""
    if isinstance(rows, slice):
        return f"{rows.start}:{rows.stop}"
    listed = [int(r) for r in rows]
    return "[" + ", ".join(map(str, listed[:8])) + (", ..." if len(listed) > 8 else "") + "]"


def check_loss(value: float, step: int, rows, inputs=None, beta: float | None = None,
               model: torch.nn.Module | None = None) -> float:
    """``value``, or an error for a non-finite loss (called before backward: nothing is updated).

    ``inputs``: the micro-batch's tensors the loss was computed from, in ``LOSS_INPUTS`` order (None
    for one not used); a non-finite one is named. When all are finite the loss itself overflowed and
    the likely causes are listed, none asserted (``beta``: the KL weight; ``model``: its largest
    weight and LoRA scale)."""
    if math.isfinite(value):
        return value
    head = f"step {step}: the loss of micro-batch rows {_rows(rows)} is {value}"
    state = f"; {weights_state(model)}" if model is not None else ""
    if inputs is None:
        raise NonFiniteError(f"{head}: its inputs (the policy's log-probs, the advantages) or the loss computation "
                             f"are not finite{state}; nothing was updated")
    named = [(name, t) for name, t in zip(LOSS_INPUTS, inputs) if t is not None]
    bad = first_nonfinite(named)
    if bad is not None:
        raise NonFiniteError(f"{head}: its input, the {bad[0]}, is not finite ({_count(bad[1])}){state}; "
                             "nothing was updated")
    causes = [f"the KL weight loss.beta = {beta:.3g} times the KL"] if beta else []
    adv = dict(named).get("advantages")
    if adv is not None and adv.numel():
        causes.append(f"extreme advantages (max |A| = {float(adv.detach().abs().max()):.3g})")
    causes.append("log-probs made extreme by the adapter (its scale lora_alpha / r, or weights grown by a high "
                  "optim.lr)")
    raise NonFiniteError(f"{head}, from finite inputs ({', '.join(n for n, _ in named)}): the loss computation "
                         f"overflowed. Likely causes (none certain): {'; '.join(causes)}{state}; nothing was updated")


class GradGuard:
    """The optimizer update, unless the gradient norm is non-finite: then it is skipped (one inf/NaN
    gradient would turn the adapter and Adam's moments NaN for good) with a warning naming the step
    and the first parameter whose gradient is non-finite; ``max_in_a_row`` skipped updates in a row
    raise ``NonFiniteError`` (the run cannot recover by skipping). Under DDP the gradients are
    all-reduced first, so every rank decides the same."""

    max_in_a_row = 3

    def __init__(self):
        self.in_a_row = 0

    def step(self, optimizer, grad_norm: torch.Tensor, model: torch.nn.Module, step: int) -> int:
        """``optimizer.step()`` and 0, or 1 when the update was skipped."""
        if bool(torch.isfinite(grad_norm)):
            self.in_a_row = 0
            optimizer.step()
            return 0
        self.in_a_row += 1
        grads = ((n, p.grad) for n, p in model.named_parameters() if p.requires_grad)
        bad = first_nonfinite(grads)
        name = repr(bad[0]) if bad else "(none found: the norm itself overflowed)"
        msg = (f"step {step}: gradient norm is {float(grad_norm)}; first non-finite gradient: {name}")
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(f"{msg}; {self.in_a_row} updates in a row had a non-finite gradient, so training "
                                 "stopped (the adapter is unchanged since the last good update; lower optim.lr)")
        warnings.warn(f"{msg}; optimizer step skipped (the adapter is unchanged; see update/skipped)",
                      RuntimeWarning, stacklevel=4)
        return 1


def finite_score(value, where: str) -> float:
    """``value`` as a finite float, or ``NonFiniteError`` naming ``where`` (NaN, inf, an int too
    large for a float)."""
    try:
        out = float(value)
    except OverflowError:
        raise NonFiniteError(f"{where} is an int too large for a float ({short_repr(value, 60)}); scores must be finite "
                             "floats") from None
    if not math.isfinite(out):
        raise NonFiniteError(f"{where} is {out}; scores must be finite floats (return None, not NaN, for "
                             "'not applicable')")
    return out

