"""The clean policy's side of one GRPO step: its log-probs ``old_logp``, entropy and IS weights.

The clipped loss compares the policy being updated with the policy before the update (``old_logp``),
and truncated importance weights (``grpo.importance_weights``) compare that policy with the rollout
engine's sampling log-probs. ``loss.old_logp`` says where ``old_logp`` comes from:

* ``"pass"``: a separate no-grad forward over the whole batch (eval mode, micro-batches of
  ``loss.micro_batch``) before the update, as ``OldPolicy.run_pass`` does;
* ``"fold"`` (default): no separate forward. The first update iteration's forward runs at exactly
  the pre-update parameters (the optimizer steps only after the whole pass over the batch), so each
  micro-batch's ``logp.detach()`` *is* its ``old_logp``, and the entropy is taken from the same logits
  under no_grad (``OldPolicy.forward``); iterations 2..mu reuse what the first stored.

Both fill the same tensors micro-batch by micro-batch (``OldPolicy.fill``), with the same slices and
the same kernels, so on the CPU the two modes give bit-equal log-probs, weights, metrics and adapters
(tests/test_old_policy.py). On CUDA an NVFP4 layer runs the same ``kernels.nvfp4_linear`` with or
without autograd, so equal values are expected there too; the gpu-marked tests check them within a
tolerance (bf16 logit rounding) and warn on any difference, they do not assert bit-equality.
The fold runs the forward in train mode: with an active dropout
(``active_dropout``: an ``nn.Dropout`` with p > 0, such as a LoRA adapter attached with dropout, or an
attention module's ``attention_dropout`` > 0) train-mode log-probs are not the clean policy's, so
``resolve_mode`` falls back to ``"pass"`` and warns once.
"""

from __future__ import annotations

import warnings

import torch

from qerl_kit.config_types import OLD_LOGP_MODES
from qerl_kit.grpo import importance_weights
from qerl_kit.logprobs import completion_logprobs, row_groups

__all__ = ["OLD_LOGP_MODES", "OldPolicy", "active_dropout", "resolve_mode"]

# config attributes some architectures read their dropout from (a model may apply them functionally)
_CONFIG_DROPOUTS = ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                    "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout", "dropout")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def active_dropout(model: torch.nn.Module) -> str | None:
    """The first thing that makes ``model``'s train-mode forward differ from its eval-mode one, or None:
    a dropout module with p > 0 (its name), a module's ``attention_dropout`` > 0 (HF attention layers
    apply it functionally: ``name.attention_dropout``), or a dropout rate > 0 in ``model.config``."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return name or type(module).__name__
        if _positive(getattr(module, "attention_dropout", None)):
            return f"{name}.attention_dropout"
    config = getattr(model, "config", None)
    for key in _CONFIG_DROPOUTS:
        if _positive(getattr(config, key, None)):
            return f"config.{key}"
    return None


def resolve_mode(mode: str, model: torch.nn.Module) -> str:
    """The mode a Trainer runs ``loss.old_logp = mode`` in: ``"fold"`` becomes ``"pass"`` (with one
    warning) when the model has an active dropout, so that dropout never changes ``old_logp``."""
    if mode not in OLD_LOGP_MODES:
        raise ValueError(f"loss.old_logp must be one of {OLD_LOGP_MODES}; got {mode!r}")
    where = active_dropout(model) if mode == "fold" else None
    if where is None:
        return mode
    warnings.warn(f"loss.old_logp='fold' takes the old log-probs from the first update's train-mode forward, but "
                  f"the model has an active dropout ({where}), so they would not be the clean policy's: using "
                  "loss.old_logp='pass' (a separate eval-mode pass) instead; set lora_dropout / attention_dropout "
                  "to 0 to fold it", UserWarning, stacklevel=3)
    return "pass"


class OldPolicy:
    """``old_logp`` [n, C], ``entropy`` [n, C] and ``is_weights`` [n, C] (None without IS correction) of
    one step's batch, filled micro-batch by micro-batch (``fill``) by a separate pass (``run_pass``) or
    by the first update iteration (``forward``); ``ready`` once every row is filled (``finish``)."""

    def __init__(self, batch, mask: torch.Tensor, is_mode: str | None, is_cap: float):
        self.batch, self.mask, self.is_mode, self.is_cap = batch, mask, is_mode, is_cap
        self.old_logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        self.entropy = torch.zeros_like(self.old_logp)
        self.is_weights = torch.zeros_like(self.old_logp) if is_mode else None
        self.ready = False

    def fill(self, sl: slice, logp: torch.Tensor, entropy: torch.Tensor) -> None:
        """Store the clean policy's log-probs and entropy of rows ``sl``; their IS weights follow from
        them (per token, or per row for the sequence modes, so a slice of rows is computed alone;
        weights only: the statistics are ``finish``'s, so no host sync per micro-batch)."""
        self.old_logp[sl] = logp.detach()
        self.entropy[sl] = entropy
        if self.is_mode:
            self.is_weights[sl] = importance_weights(self.old_logp[sl], self.batch.logprobs[sl], self.mask[sl],
                                                     mode=self.is_mode, cap=self.is_cap, stats=False)[0]

    def finish(self) -> dict[str, float]:
        """Mark every row filled; the IS statistics over the whole batch (TRL's names; {} without IS)."""
        self.ready = True
        if not self.is_mode:
            return {}
        return importance_weights(self.old_logp, self.batch.logprobs, self.mask, mode=self.is_mode, cap=self.is_cap)[1]

    def _logprobs(self, model, sl: slice, temperature: float, with_entropy: bool, bounds=None):
        b = self.batch
        return completion_logprobs(model, b.prompt_ids[sl], b.prompt_mask[sl], b.completion_ids[sl],
                                   b.completion_mask[sl], temperature, with_entropy, bounds=bounds)

    @torch.no_grad()
    def run_pass(self, model, temperature: float, micro_batch, bounds=None) -> dict[str, float]:
        """``loss.old_logp = "pass"``: one no-grad forward of every micro-batch (``micro_batch`` rows at a
        time, or the row selections of ``logprobs.micro_batches``, with ``bounds``: their
        ``micro_batch_plan`` bounds), in eval mode; returns ``finish()``'s IS statistics."""
        model.eval()
        groups = row_groups(micro_batch, self.mask.shape[0])
        for sl, bound in zip(groups, bounds or [None] * len(groups), strict=True):
            self.fill(sl, *self._logprobs(model, sl, temperature, True, bound))
        return self.finish()

    def forward(self, model, sl: slice, temperature: float, bounds=None) -> torch.Tensor:
        """The update's log-probs of rows ``sl`` (with grad; ``bounds``: their ``padding_bounds`` if known);
        before ``ready`` (the first iteration of a folded step) the same forward's detached log-probs and
        no-grad entropy are stored as the old ones."""
        if self.ready:
            return self._logprobs(model, sl, temperature, False, bounds)
        logp, entropy = self._logprobs(model, sl, temperature, True, bounds)
        self.fill(sl, logp, entropy)
        return logp
