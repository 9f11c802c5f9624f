"""Adaptive Quantization Noise (AQN): staged Gaussian noise merged into RMSNorm scales.

QeRL adds channel-wise noise ``Z ~ N(0, sigma^2)`` to the scale vector ``w`` of every RMSNorm
whose output feeds quantized projections: the input norm before q/k/v and the post-attention
norm before gate/up. Since ``RMSNorm(x) = w * x_hat``, the next layer sees
``(w + Z) * x_hat = x_hat * w * (1 + Z/w)``: a row-wise multiplicative perturbation of its
weights, with no extra parameters and no change to the 4-bit kernels.

Schedule: ``stages`` (K) intervals split ``total_steps`` evenly. Stage 0 is noise-free
(quantization noise only); stage k >= 1 uses
``sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))``, so stage 1 is
exactly sigma_start and stage K-1 exactly sigma_end (the official code's exponent; the paper
prints (k-1)/(K-1), which never reaches sigma_end). Defaults 1e-2 -> 5e-4 with K = 10 follow the
paper's Table 4.

Where we depart from the official code, on purpose:

* Norms are found by structure, not by class name: a probe forward pass records which norm's
  output tensor is the very input of quantized projections (of the linear projections in an
  unquantized model, for the bf16 + AQN ablation). The projections return zeros of their output
  shape during the probe: it reads where tensors go, so no matmul runs and no kernel is compiled or
  repacks a weight for it (on a GPU a 4-token probe sent a 32B model's gate/up to humming-kernels,
  which kept a second repacked copy of them, 9.5 GiB, that nothing else used). So Qwen2, Qwen3 and Llama work
  (Qwen3's q/k norms and the final norm feed no quantized projection and are left alone), and
  finding none is an error. The official code matched transformers' class names inside vLLM,
  whose norms are vLLM's own class, so its noise most likely never applied.
* Every application starts from a saved clean copy, and ``restore`` copies the exact original
  bits back, so noise never accumulates over steps (the official code relied on re-syncing
  norms). A state-dict hook substitutes the clean values while noise is on, so noise never
  reaches a saved checkpoint.
* Noise is resampled at every ``apply`` (one rollout step) by default; ``resample="forward"``
  draws fresh noise at every forward call of each norm instead (the paper's wording).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import operator
from dataclasses import dataclass, field

import torch
from torch import nn

from qerl_kit.linear import QuantLinear


def _projection_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose input norms AQN perturbs: the quantized linears, or, in a model with none
    (the bf16 + AQN ablation), every nn.Linear except the output head and LoRA's own matrices."""
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if quantized:
        return quantized
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lora_parts = {id(m) for name, m in model.named_modules() if ".lora_" in name}
    return [m for m in model.modules()
            if isinstance(m, nn.Linear) and m is not head and id(m) not in lora_parts]


def find_noise_norms(model: nn.Module, probe_ids: torch.Tensor | None = None) -> list[nn.Module]:
    """The norm modules (1-D ``weight``) whose output is the input of a projection layer.

    Projection layers are the quantized linears (or, in an unquantized model, the linear layers
    other than the output head). Found by a probe forward pass: a norm's output tensor must be
    the very tensor object a projection receives. Works through peft wrappers (LoRA,
    modules_to_save copies).
    """
    outputs: dict[int, nn.Module] = {}
    keep: list[torch.Tensor] = []  # keep probe tensors alive so ids stay unique
    found: dict[int, nn.Module] = {}

    def norm_hook(module, _inputs, output):
        if isinstance(output, torch.Tensor):
            keep.append(output)
            outputs[id(output)] = module

    def linear_hook(_module, inputs):
        x = inputs[0] if inputs else None
        if isinstance(x, torch.Tensor) and id(x) in outputs:
            norm = outputs[id(x)]
            found[id(norm)] = norm

    targets = _projection_layers(model)
    if not targets:
        raise ValueError("AQN found no projection layers (quantized or linear) in the model")
    target_ids = {id(m) for m in targets}
    handles = [m.register_forward_pre_hook(linear_hook) for m in targets]
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (id(module) not in target_ids and isinstance(weight, nn.Parameter) and weight.ndim == 1
                and not list(module.children())):
            handles.append(module.register_forward_hook(norm_hook))
    _check_probe_forward(model)
    if probe_ids is None:  # on the model's device (a quantized layer's buffers count: it may have no parameters)
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        probe_ids = torch.arange(1, 5, device=first.device if first is not None else None).unsqueeze(0)
    try:
        with torch.no_grad(), _shapes_only(targets):
            model(input_ids=probe_ids)
    finally:
        for h in handles:
            h.remove()
    return list(found.values())


@contextlib.contextmanager
def _shapes_only(layers: list[nn.Module]):
    """Inside: each of ``layers`` returns zeros of its output shape (hooks still see its input), and
    no kernel runs; on leaving, each gets its own ``forward`` back (an instance attribute it had
    before included)."""
    saved = [(m, vars(m).get("forward")) for m in layers]

    def zeros(out_features: int):
        return lambda x, *args, **kwargs: x.new_zeros(*x.shape[:-1], out_features)

    try:
        for m, _ in saved:
            m.forward = zeros(m.out_features)
        yield
    finally:
        for m, before in saved:
            if before is None:
                del m.forward
            else:
                m.forward = before


def _check_probe_forward(model: nn.Module) -> None:
    """The probe calls ``model(input_ids=...)`` as a causal LM is called; a module whose forward takes
    no ``input_ids`` (an ``nn.Sequential``) is refused here, by name, not with a TypeError from inside."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read: let the call itself say
        return
    if "input_ids" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    raise ValueError(f"AQN finds the norms to perturb with a probe forward pass model(input_ids=...), as a causal "
                     f"LM is called; {type(model).__name__}.forward takes no input_ids (its arguments: "
                     f"{', '.join(params) or 'none'}). Apply AQN to a causal LM (a transformers model or the "
                     f"peft model wrapping one)")


def check_step(step, key: str = "step") -> int:
    """A schedule step, the one rule of every method that takes one (``stage``, ``sigma``, ``apply``,
    ``noise``, the panel's ``readout``): an int >= 0 (a numpy or torch integer too), never a bool, float
    or string (any of those would otherwise land silently in the noise-free stage 0); a
    step past ``total_steps`` is allowed (the last stage's sigma), as a run past its schedule is."""
    from qerl_kit.config_types import ConfigError, short_repr

    try:
        value = None if isinstance(step, bool) or getattr(step, "dtype", None) == torch.bool else operator.index(step)
    except TypeError:  # float, str, None...: no exact integer value
        value = None
    if value is None or value < 0:
        allowed = "an int >= 0"
        raise ConfigError(f"{key} must be {allowed} (a 0-based training step; stage 0 is the first "
                          f"total_steps / stages of them); got {short_repr(step)}", key, step, allowed)
    return value


# The values that define a schedule: checked together by AQN.checked, at construction and on every change.
SCHEDULE_FIELDS = ("sigma_start", "sigma_end", "stages", "total_steps", "seed", "resample", "allow_increasing")


@dataclass
class AQN:
    """The AQN schedule and the noise it applies; all state (RNG, clean copies) lives here."""

    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10
    total_steps: int = 600
    seed: int = 0
    resample: str = "step"  # "step": once per apply(); "forward": fresh noise at every forward
    allow_increasing: bool = False  # sigma_end > sigma_start (noise that grows) only when asked for
    _generator: torch.Generator = field(init=False, repr=False)
    _clean: dict[int, tuple[nn.Module, torch.Tensor]] = field(init=False, repr=False, default_factory=dict)
    _norms: dict[int, list[nn.Module]] = field(init=False, repr=False, default_factory=dict)
    _handles: list = field(init=False, repr=False, default_factory=list)

    def __post_init__(self):
        # The same rules as the config's aqn section (qerl_kit.config): typed values, finite
        # sigmas > 0, and sigma_end <= sigma_start unless allow_increasing=True.
        for key, value in self.checked().items():
            object.__setattr__(self, key, value)
        self._generator = torch.Generator().manual_seed(self.seed)
        object.__setattr__(self, "_ready", True)

    # ---- the schedule's values: one set of rules, at construction, on assignment and in update() ----
    def checked(self, **changes) -> dict:
        """The schedule's values with ``changes`` applied, coerced and checked as the constructor
        checks them (a ``ConfigError`` naming the key otherwise); nothing is assigned."""
        from qerl_kit.config_types import RESAMPLE, ConfigError, check_aqn_sigmas, check_seed, check_value, short_repr

        unknown = [k for k in changes if k not in SCHEDULE_FIELDS]
        if unknown:
            raise ConfigError(f"AQN has no schedule value {', '.join(short_repr(k, 60) for k in unknown[:5])}; the "
                              f"values are: {', '.join(SCHEDULE_FIELDS)}", unknown[0], changes[unknown[0]], None)
        v = {key: changes.get(key, getattr(self, key)) for key in SCHEDULE_FIELDS}
        v["stages"] = check_value("stages", v["stages"], int, ge=3, why="a noise-free stage 0 and a decay from "
                                  "sigma_start to sigma_end over stages 1..K-1")
        v["total_steps"] = check_value("total_steps", v["total_steps"], int, ge=1, why="the run's length, which the "
                                       "stages split evenly")
        if v["total_steps"] < v["stages"]:  # name the value that was changed (the total, when both were)
            key = "stages" if "stages" in changes and "total_steps" not in changes else "total_steps"
            allowed = (f"<= total_steps = {v['total_steps']}" if key == "stages"
                       else f">= stages = {v['stages']}")
            raise ConfigError(f"{key} must be {allowed} (every stage needs at least one step); got "
                              f"{v[key]}", key, v[key], allowed)
        v["seed"] = check_seed("seed", v["seed"])  # seeds a torch.Generator as it is
        v["resample"] = check_value("resample", v["resample"], str, choices=RESAMPLE,
                                    why="step: fresh noise at every apply(); forward: at every forward call")
        v["sigma_start"], v["sigma_end"], v["allow_increasing"] = check_aqn_sigmas(
            v["sigma_start"], v["sigma_end"], v["allow_increasing"], prefix="", flag="AQN(..., allow_increasing=True)")
        return v

    def update(self, **changes) -> None:
        """Change several schedule values at once (e.g. both sigmas, or stages and total_steps): all
        are checked together first, so a refused change leaves the AQN as it was. A new ``seed``
        restarts the noise stream from that seed, as the constructor does."""
        values = self.checked(**changes)
        for key in SCHEDULE_FIELDS:
            object.__setattr__(self, key, values[key])
        if "seed" in changes:
            self._generator.manual_seed(self.seed)

    def __setattr__(self, name, value):
        # a schedule value set after construction (a widget's slider, trainer.aqn.sigma_start = ...) obeys
        # the constructor's rules, against the other values as they are now: stages >= 3 and <= total_steps,
        # a known resample mode, sigma_end <= sigma_start unless allow_increasing... (never a
        # ZeroDivisionError at the next sigma(step)). During __init__ the values are checked all together
        # in __post_init__.
        if name in SCHEDULE_FIELDS and getattr(self, "_ready", False):
            from qerl_kit.config_types import ConfigError

            try:
                self.update(**{name: value})
            except ConfigError as err:
                if name not in ("sigma_start", "sigma_end") or not str(err.allowed).startswith("<= sigma_start"):
                    raise
                # one sigma assigned against the other's current value: say how to change both at once
                raise ConfigError(f"{err}; to change both sigmas at once, use aqn.update(sigma_start=..., "
                                  "sigma_end=...)", err.key, err.value, err.allowed) from None
            return
        super().__setattr__(name, value)

    # ---- the schedule (pure) -------------------------------------------------------------
    def stage(self, step: int) -> int:
        """The stage of ``step`` (0-based steps, ``check_step``): floor(step / (total_steps / stages)), capped."""
        step = check_step(step)
        return min(step * self.stages // self.total_steps, self.stages - 1)

    def sigma(self, step: int) -> float:
        """The noise std at ``step`` (``check_step``): 0 in stage 0, then exponential decay start -> end."""
        k = self.stage(step)
        if k == 0:
            return 0.0
        ratio = self.sigma_end / self.sigma_start
        return self.sigma_start * math.pow(ratio, (k - 1) / (self.stages - 2))

    def schedule(self) -> list[tuple[int, float]]:
        """(first step, sigma) of every stage, for plots and sliders."""
        return [(math.ceil(k * self.total_steps / self.stages), self.sigma(math.ceil(k * self.total_steps / self.stages)))
                for k in range(self.stages)]

    # ---- applying noise ------------------------------------------------------------------
    def norms(self, model: nn.Module) -> list[nn.Module]:
        """The norms this AQN perturbs in ``model`` (found once per model, by structure)."""
        key = id(model)
        if key not in self._norms:
            norms = find_noise_norms(model)
            if not norms:
                raise ValueError("AQN found no norm whose output feeds a quantized projection; "
                                 "refusing to run as a silent no-op")
            self._norms[key] = norms
        return self._norms[key]

    def _draw(self, weight: torch.Tensor, sigma: float) -> torch.Tensor:
        z = torch.randn(weight.shape, generator=self._generator, dtype=torch.float32)
        return (z * sigma).to(weight.device)

    def _perturb(self, norm: nn.Module, sigma: float) -> None:
        clean = self._clean[id(norm)][1]
        noisy = clean.to(torch.float32) + self._draw(clean, sigma)
        norm.weight.data.copy_(noisy.to(clean.dtype))

    def apply(self, model: nn.Module, step: int, sigma: float | None = None) -> int:
        """Add fresh noise (std ``sigma``, default ``self.sigma(step)``) to each found norm.

        Returns the number of norm vectors perturbed; 0 in the noise-free stage. Noise is always
        drawn around the clean weights, so calling ``apply`` twice does not accumulate noise.
        """
        from qerl_kit.config_types import check_sigma

        step = check_step(step)  # checked even when an explicit sigma makes the schedule's unused
        sigma = self.sigma(step) if sigma is None else check_sigma("sigma", sigma, zero=True)
        norms = self.norms(model)
        self.restore(model)
        if sigma == 0.0:
            return 0
        for norm in norms:
            self._clean[id(norm)] = (norm, norm.weight.detach().clone())
            self._handles.append(norm._register_state_dict_hook(self._clean_state_dict_hook))
            if self.resample == "forward":
                self._handles.append(norm.register_forward_pre_hook(
                    lambda module, _inputs, s=sigma: self._perturb(module, s)))
            self._perturb(norm, sigma)
        return len(norms)

    def restore(self, model: nn.Module | None = None) -> int:
        """Put the exact original norm weights back; returns how many were restored."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        restored = 0
        for norm, clean in self._clean.values():
            norm.weight.data.copy_(clean)
            restored += 1
        self._clean.clear()
        return restored

    @property
    def active(self) -> bool:
        return bool(self._clean)

    @contextlib.contextmanager
    def noise(self, model: nn.Module, step: int, sigma: float | None = None):
        """``with aqn.noise(model, step): rollouts = ...`` applies noise and always restores it."""
        count = self.apply(model, step, sigma)
        try:
            yield count
        finally:
            self.restore(model)

    def _clean_state_dict_hook(self, module, state_dict, prefix, _metadata):
        entry = self._clean.get(id(module))
        if entry is not None and prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = entry[1].clone()

    # ---- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"config": {"sigma_start": self.sigma_start, "sigma_end": self.sigma_end,
                           "stages": self.stages, "total_steps": self.total_steps,
                           "seed": self.seed, "resample": self.resample},
                "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.update(**state["config"])  # checked together, as the constructor checks them
        self._generator.set_state(state["generator"])
