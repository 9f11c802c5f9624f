"""A memory planner for one GPU: will this model, LoRA rank, batch and sequence length fit?

``plan_memory("Qwen2.5-7B", lora_r=32, rollout_batch=128, max_new_tokens=4096, ...)`` bounds, from
the model's shape alone (``qerl_kit.models.PRESETS`` or any transformers config), the bytes a GRPO
step allocates (``qerl_kit.memory_terms`` computes each term and says which code it follows):

* **kept for the run**: the projections in the 4-bit format (``bits_per_weight`` of
  ``qerl_kit.formats``) or bf16 with ``fmt="none"``; embeddings, the output head (unless tied),
  norms and q/k/v biases in bf16; the StaticEngine's fused copy of q/k/v and gate/up (``fused``,
  NVFP4 and bf16 bases; none with ``share_weights``, where the model's tensors are that copy);
  humming-kernels' repacked copy of every NVFP4 weight the routing table can send to it
  (``humming``); LoRA ``r * (in + out)`` per targeted projection, its gradients and the
  optimizer state (AdamW: two moments in the parameters' dtype; ``adamw8bit``: one byte each);
  cuBLAS's workspace per CUDA stream that ran a matmul;
* **rollout**: the KV cache as the engine allocates it (the prompt padded to the engine's bucket,
  stored once per group of samples by the ``StaticEngine``; ``engine="hf"`` stores every row), the
  decode state, one decode step's logits and sampling, one prefill chunk;
* **training** (one micro-batch; the log-prob pass is the same forward without gradients): the
  activations kept for backward (with activation checkpointing each layer's input plus one layer
  recomputed), one layer's gradients, the logits in the model's dtype with their gradient, one
  float32 log-prob chunk (``qerl_kit.logprobs.CHUNK_ELEMS``) forward and backward, one dequantized
  weight, and ``dense_cache_bytes`` of dequantized weights kept for these passes.

Rollouts and updates run one after the other; with ``keep_cache`` (the StaticEngine's default) the
KV cache and decode state stay allocated while the policy trains. ``MemoryPlan.allocated`` is
static + max(rollout, training + kept): an upper bound of ``torch.cuda.max_memory_allocated()``
over a GRPO step, checked against every measured peak in tests/data/measured_peaks.json (1.04-1.27x
of them; one 32B run on an H100 exceeds it by 2% and is a known gap; docs/training.md, "Memory"). ``peak`` adds ``overhead`` (10% by default) for what that counter does
not see: the CUDA context, the allocator's reserved but unused blocks. Not counted: evaluation
calls of other shapes, a colocated vLLM engine (``vllm_memory_share``), other processes.

``dense_cache_bytes`` defaults to 0, a run with ``model.dense_cache_gib: 0``. The Trainer's default
(``dense_cache_gib: null``, auto) caches nothing in its first step and up to every quantized
projection in bf16 (``dense_update.dense_projection_bytes``) from the second, as much as the free
memory allows: such a run is bounded by ``dense_cache_bytes="all"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qerl_kit.config_types import (NEW_TOKENS_RULE, OPTIMIZERS, ConfigError, check_names, check_rule, check_value,
                                   short_repr)
from qerl_kit import memory_terms as T
from qerl_kit.table import html_table, human_bytes, text_table

__all__ = ["MemoryPlan", "plan_memory", "model_shape"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


_SIZE = dict(ge=1, why="a model dimension")
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_MODEL_ALLOWED = "a preset name of qerl_kit.models.PRESETS, a transformers config or a dict of its sizes"


def model_shape(model: Any) -> dict:
    """The numbers the planner needs, from a preset name, a transformers config or a dict. A model
    object (an ``nn.Module``), a missing size or one that is not an int >= 1 is a ConfigError naming it."""
    import torch

    if isinstance(model, str):
        from qerl_kit.models import PRESETS

        if model not in PRESETS:
            raise ConfigError(f"unknown model preset {short_repr(model)}; choose one of {sorted(PRESETS)} "
                              "or pass a transformers config", "model", model, _MODEL_ALLOWED)
        cfg = dict(PRESETS[model])
    elif isinstance(model, dict):
        cfg = dict(model)
    elif isinstance(model, torch.nn.Module):  # the weights are not the plan's input: their config is
        raise ConfigError(f"model must be {_MODEL_ALLOWED}; got a {type(model).__name__} model object "
                          "(pass its .config)", "model", model, _MODEL_ALLOWED)
    else:  # a transformers PretrainedConfig (or anything with the same attributes)
        cfg = {k: getattr(model, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "tie_word_embeddings",
                                                "model_type") if getattr(model, k, None) is not None}
    missing = [k for k in _SHAPE_KEYS if cfg.get(k) is None]
    if missing:
        raise ConfigError(f"model must be {_MODEL_ALLOWED}; {short_repr(model)} has no {', '.join(missing)}",
                          "model", model, _MODEL_ALLOWED)
    for k in (*_SHAPE_KEYS, "num_key_value_heads", "head_dim"):  # sizes: what a tensor's dimension can be
        if cfg.get(k) is not None:
            cfg[k] = check_value(f"model.{k}", cfg[k], int, **_SIZE)
    heads = cfg["num_attention_heads"]
    shape = dict(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], inter=cfg["intermediate_size"],
                 layers=cfg["num_hidden_layers"], heads=heads,
                 kv_heads=cfg.get("num_key_value_heads") or heads,
                 head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                 tied=bool(cfg.get("tie_word_embeddings", False)),
                 qkv_bias=cfg.get("arch", cfg.get("model_type")) == "qwen2")
    return shape


def layer_projections(s: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one decoder layer."""
    h, q, kv, i = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


_VALUE_BYTES = (1, 2, 4)


def _value_bytes(key: str, value: Any) -> int:
    """Bytes per stored value: 1 (fp8/int8), 2 (bf16/fp16) or 4 (fp32)."""
    out = check_value(key, value, int, ge=1, le=4, why="bytes per value: 1 (fp8), 2 (bf16/fp16) or 4 (fp32)")
    if out not in _VALUE_BYTES:
        raise ConfigError(f"{key} must be one of {_VALUE_BYTES} (bytes per value: fp8, bf16/fp16, fp32); "
                          f"got {short_repr(value)}", key, value, str(_VALUE_BYTES))
    return out


def _check_gpu_bytes(gpu_bytes: Any) -> int | None:
    """The GPU's memory: None (not compared) or an int >= 1 of bytes (``"80GB"`` is not bytes)."""
    return check_value("gpu_bytes", gpu_bytes, int | None, ge=1,
                       why="the GPU's memory in bytes, e.g. torch.cuda.mem_get_info()[1] or 80 * 2**30")


@dataclass
class MemoryPlan:
    """Bytes by part; ``allocated`` = static + max(rollout, training + kept), ``peak`` = allocated x (1 + overhead).

    ``kept``: the rollout parts that stay allocated while the policy trains (the StaticEngine's KV
    cache and decode state with ``keep_cache``)."""

    model: str
    parts: dict[str, int]
    settings: dict[str, Any] = field(default_factory=dict)
    overhead: float = 0.10
    gpu_bytes: int | None = None
    kept: tuple[str, ...] = ()

    @property
    def static(self) -> int:
        return sum(v for k, v in self.parts.items() if not k.startswith(("rollout", "training")))

    @property
    def rollout(self) -> int:
        return sum(v for k, v in self.parts.items() if k.startswith("rollout"))

    @property
    def training(self) -> int:
        return sum(v for k, v in self.parts.items() if k.startswith("training"))

    @property
    def kept_bytes(self) -> int:
        """Bytes of the rollout parts still allocated during training (``kept``)."""
        return sum(self.parts[k] for k in self.kept)

    @property
    def allocated(self) -> int:
        """The bound of ``torch.cuda.max_memory_allocated()`` over a step: the larger phase on top of the static parts."""
        return self.static + max(self.rollout, self.training + self.kept_bytes)

    @property
    def peak(self) -> int:
        return int(self.allocated * (1 + self.overhead))

    def fits(self, gpu_bytes: int | None = None) -> bool:
        gpu = _check_gpu_bytes(gpu_bytes) or self.gpu_bytes
        if gpu is None:
            raise ValueError("pass the GPU's memory in bytes (e.g. torch.cuda.mem_get_info()[1])")
        return self.peak <= gpu

    def rows(self) -> list[dict]:
        rows = [{"part": k + (" (kept while training)" if k in self.kept else ""), "bytes": human_bytes(v),
                 "GiB": round(v / 2**30, 2)} for k, v in self.parts.items()]
        rows.append({"part": "allocated: static + max(rollout, training" + (" + kept" if self.kept else "") + ")",
                     "bytes": human_bytes(self.allocated), "GiB": round(self.allocated / 2**30, 2)})
        rows.append({"part": f"peak: allocated x {1 + self.overhead:.2f} (CUDA context, allocator slack)",
                     "bytes": human_bytes(self.peak), "GiB": round(self.peak / 2**30, 2)})
        return rows

    def summary(self) -> str:
        s = self.settings
        text = (f"{self.model} in {s.get('fmt')}, LoRA r={s.get('lora_r')}, rollout {s.get('rollout_batch')} x "
                f"{s.get('prompt_len')}+{s.get('max_new_tokens')} tokens, micro-batch {s.get('micro_batch')}: "
                f"peak ~{self.peak / 2**30:.1f} GiB")
        if self.gpu_bytes:
            text += f" of {self.gpu_bytes / 2**30:.0f} GiB ({'fits' if self.fits() else 'does NOT fit'})"
        return text

    def __str__(self) -> str:
        return self.summary() + "\n" + text_table(self.rows())

    def _repr_html_(self) -> str:
        return html_table(self.rows(), caption=self.summary())


def plan_memory(model: Any = "Qwen2.5-7B", fmt: str = "nvfp4", lora_r: int = 32,
                targets: tuple[str, ...] = _PROJECTIONS, optimizer: str = "adamw8bit",
                rollout_batch: int = 128, prompt_len: int = 256, max_new_tokens: int = 4096,
                micro_batch: int | None = None, gradient_checkpointing: bool = True, kv_bytes: int = 2,
                act_bytes: int = 2, lora_bytes: int = 2, overhead: float = 0.10,
                gpu_bytes: int | None = None, group_size: int = 1, engine: str = "static", fused: bool = True,
                keep_cache: bool = True, humming: bool = True, dense_cache_bytes: int | str = 0,
                max_rows: int | None = None, share_weights: bool = False) -> MemoryPlan:
    """Bound the memory of a QeRL run; see the module docstring for what each part counts. Every
    argument is checked where it enters (a ConfigError naming it): sizes and counts are ints >= 1,
    ``micro_batch`` at most ``rollout_batch`` (default: 8 or the whole batch if smaller), bytes per value
    1, 2 or 4, ``overhead`` in [0, 10], ``targets`` projection names (one name as a string is that name).
    ``prompt_len`` is the longest prompt and ``max_new_tokens`` the longest completion: the engine
    and every micro-batch pad to the batch's longest (a batch of shorter ones allocates less).
    ``engine``: ``static`` (the StaticEngine: ``fused`` copy, ``keep_cache``, ``share_weights``: the
    model's q/k/v and gate/up are the fused buffers, no copy) or ``hf`` (transformers' generate).
    ``humming``: count humming-kernels' repacked NVFP4 weights (where it is installed, ``kernels``
    backend ``auto``). ``dense_cache_bytes``: bytes of dequantized weights kept for the
    log-prob and update passes, or ``"all"`` (the bf16 bytes of every quantized projection).
    ``max_rows``: the StaticEngine's ``max_rows`` (``rollout.max_rows``): it decodes at most that many
    rows at once, whole groups (``max_rows // group_size`` prompts, at least one), so the KV cache,
    decode state and prefill hold that many rows; None: the whole batch."""
    a = _checked_settings(fmt=fmt, optimizer=optimizer, lora_r=lora_r, rollout_batch=rollout_batch,
                          prompt_len=prompt_len, max_new_tokens=max_new_tokens, micro_batch=micro_batch,
                          gradient_checkpointing=gradient_checkpointing, kv_bytes=kv_bytes, act_bytes=act_bytes,
                          lora_bytes=lora_bytes, overhead=overhead, gpu_bytes=gpu_bytes, group_size=group_size)
    a |= _checked_engine(engine, fused, keep_cache, humming, share_weights)
    a |= _checked_rows(max_rows, a)
    s = model_shape(model)
    proj = layer_projections(s)
    targets = check_names("targets", targets, proj, what="LoRA target", empty=False)
    a["dense_cache_bytes"] = _checked_dense_cache(dense_cache_bytes, s, proj, a["fmt"])
    ra = a | {"rollout_batch": a["engine_rows"]}  # what one engine batch allocates
    rollout = {**T.kv_parts(s, ra), **T.decode_parts(s, proj, ra)}
    kept = tuple(k for k in rollout if a["keep_cache"] and a["engine"] == "static"
                 and k.startswith(("rollout: KV cache", "rollout: decode state")))
    parts = {**_weight_parts(s, proj, a["fmt"]), **T.engine_parts(s, proj, a), **T.humming_parts(s, proj, a),
             **_lora_parts(s, proj, targets, a), **T.fixed_parts(a), **rollout,
             **T.prefill_parts(s, proj, targets, ra), **T.training_parts(s, proj, targets, a)}
    settings = {k: a[k] for k in ("fmt", "lora_r", "optimizer", "rollout_batch", "prompt_len", "max_new_tokens",
                                  "micro_batch", "gradient_checkpointing", "group_size", "engine", "fused",
                                  "keep_cache", "humming", "dense_cache_bytes", "max_rows", "share_weights")} \
        | {"vocab": s["vocab"]}
    name = model if isinstance(model, str) else (model.get("model_type", "model") if isinstance(model, dict)
                                                 else getattr(model, "model_type", "model"))
    return MemoryPlan(str(name), parts, settings, a["overhead"], a["gpu_bytes"], kept)


ENGINES = ("static", "hf")


def _checked_engine(engine, fused, keep_cache, humming, share_weights) -> dict:
    """The rollout engine's settings: its name and the StaticEngine's switches."""
    return {"engine": check_value("engine", engine, str, choices=ENGINES),
            "fused": check_value("fused", fused, bool), "keep_cache": check_value("keep_cache", keep_cache, bool),
            "humming": check_value("humming", humming, bool),
            "share_weights": check_value("share_weights", share_weights, bool)}


def _checked_rows(max_rows, a: dict) -> dict:
    """``max_rows`` (None or an int >= 1) and ``engine_rows``, the rows one StaticEngine batch decodes
    (whole groups, as the engine splits a batch; transformers' generate decodes the whole batch)."""
    max_rows = check_value("max_rows", max_rows, int | None, ge=1, why="the most rows the engine decodes at once")
    rows, group = a["rollout_batch"], a["group_size"]
    engine_rows = rows if max_rows is None or a["engine"] != "static" else min(rows, max(1, max_rows // group) * group)
    return {"max_rows": max_rows, "engine_rows": engine_rows}


def _checked_dense_cache(value, s: dict, proj: dict, fmt: str) -> int:
    """``dense_cache_bytes``: an int >= 0 of bytes, or ``"all"`` (every quantized projection in bf16)."""
    if value == "all":
        return T.dense_cache_all(s, proj, fmt)
    return check_value("dense_cache_bytes", value, int, ge=0,
                       why='bytes of dequantized weights kept for the log-prob and update passes, or "all"')


def _checked_settings(*, fmt, optimizer, lora_r, rollout_batch, prompt_len, max_new_tokens, micro_batch,
                      gradient_checkpointing, kv_bytes, act_bytes, lora_bytes, overhead, gpu_bytes,
                      group_size) -> dict:
    """``plan_memory``'s settings, each checked and coerced (a ConfigError naming the first bad one)."""
    from qerl_kit.formats import format_names

    a = {"fmt": check_value("fmt", fmt, str, choices=format_names()),
         "optimizer": check_value("optimizer", optimizer, str, choices=OPTIMIZERS),
         "lora_r": check_value("lora_r", lora_r, int, ge=1, why="the LoRA rank")}
    rollout_batch = a["rollout_batch"] = check_value("rollout_batch", rollout_batch, int, ge=1,
                                                     why="sequences per rollout")
    a["prompt_len"] = check_value("prompt_len", prompt_len, int, ge=0, why="prompt tokens per sequence")
    a["max_new_tokens"] = check_rule("max_new_tokens", max_new_tokens, int, NEW_TOKENS_RULE)
    a["micro_batch"] = check_value("micro_batch", min(8, rollout_batch) if micro_batch is None else micro_batch,
                                   int, ge=1, le=rollout_batch,
                                   why=f"a micro-batch is a slice of the rollout batch (rollout_batch = {rollout_batch})")
    a["gradient_checkpointing"] = check_value("gradient_checkpointing", gradient_checkpointing, bool)
    for key, value in (("kv_bytes", kv_bytes), ("act_bytes", act_bytes), ("lora_bytes", lora_bytes)):
        a[key] = _value_bytes(key, value)
    a["overhead"] = check_value("overhead", overhead, float, ge=0, le=10,
                                why="a share added to the total for the CUDA context and allocator slack (0.1 = 10%)")
    a["gpu_bytes"] = _check_gpu_bytes(gpu_bytes)
    return a | _checked_group(group_size, rollout_batch)


def _checked_group(group_size, rollout_batch: int) -> dict:
    group_size = check_value("group_size", group_size, int, ge=1, le=rollout_batch,
                             why=f"samples per prompt; it must divide rollout_batch ({rollout_batch})")
    if rollout_batch % group_size:
        raise ConfigError(f"group_size must be an int >= 1 that divides rollout_batch ({rollout_batch}); "
                          f"got {group_size}", "group_size", group_size, f"a divisor of {rollout_batch}")
    return {"group_size": group_size}


def _weight_parts(s: dict, proj: dict, fmt: str) -> dict[str, int]:
    """The frozen weights: the projections in ``fmt`` (4-bit codes + a scale per block, 4 bytes of
    global scale per tensor), the rest bf16."""
    from qerl_kit.formats import DENSE

    L, h, V = s["layers"], s["hidden"], s["vocab"]
    n_proj = L * sum(i * o for i, o in proj.values())
    proj_bytes = T.projection_bytes(n_proj, fmt) + (0 if fmt == DENSE else 4 * L * len(proj))
    dense = V * h * (1 if s["tied"] else 2) + L * 2 * h + h  # embeddings (+ head), norms
    if s["qkv_bias"]:
        dense += L * (proj["q_proj"][1] + 2 * proj["k_proj"][1])
    return {f"weights: projections ({fmt})": proj_bytes, "weights: embeddings, head, norms (bf16)": dense * 2}


def _lora_parts(s: dict, proj: dict, targets, a: dict) -> dict[str, int]:
    """LoRA and its training state: the matrices, their gradients and the optimizer's moments."""
    lora_r, lora_bytes, optimizer = a["lora_r"], a["lora_bytes"], a["optimizer"]
    lora_params = s["layers"] * sum(lora_r * (proj[t][0] + proj[t][1]) for t in targets)
    opt_bytes = lora_params * (2 * lora_bytes if optimizer == "adamw" else 2)
    return {f"LoRA r={lora_r} ({lora_params / 1e6:.1f} M params)": lora_params * lora_bytes,
            "LoRA gradients": lora_params * lora_bytes, f"optimizer state ({optimizer})": opt_bytes}


VLLM_RUNTIME_BYTES = 2 << 30  # vLLM's own: CUDA graphs, activations of a step, sampler, allocator slack


def vllm_need(plan: MemoryPlan) -> int:
    """What vLLM holds of a plan's parts: the weights, the adapter, the KV cache and one decode
    step's float32 logits (the fused copy, humming's repack and our engine's buffers are ours)."""
    keep = ("weights:", "LoRA r=", "rollout: KV cache")
    logits = plan.settings["rollout_batch"] * plan.settings["vocab"] * 4
    return sum(v for k, v in plan.parts.items() if k.startswith(keep)) + logits


def vllm_memory_share(model: Any, gpu_bytes: int, *, fmt: str = "nvfp4", lora_r: int = 32,
                      rollout_batch: int = 64, max_model_len: int = 1024, margin: float = 0.15) -> float:
    """The ``gpu_memory_utilization`` a colocated vLLM engine needs for one rollout batch: its own copy
    of the weights (``fmt``), one adapter of rank ``lora_r``, a KV cache for ``rollout_batch``
    sequences of ``max_model_len`` tokens (vLLM stores every row's prompt: no prefix sharing counted),
    ``VLLM_RUNTIME_BYTES``, plus ``margin``; as a share of ``gpu_bytes``, rounded up to 0.01.
    Raises ValueError when that is more than 0.95 of the GPU (name the batch, the length and the need)."""
    if not isinstance(gpu_bytes, int) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive int; got {gpu_bytes!r}")
    plan = plan_memory(model, fmt, lora_r, rollout_batch=rollout_batch, prompt_len=0, max_new_tokens=max_model_len)
    need = vllm_need(plan) + VLLM_RUNTIME_BYTES
    share = -(-int(need * (1 + margin) * 100) // gpu_bytes) / 100
    if share > 0.95:
        raise ValueError(f"vLLM would need {human_bytes(int(need * (1 + margin)))} ({share:.0%} of the GPU) for "
                         f"rollout.batch_size = {rollout_batch} x {max_model_len} tokens; lower rollout.batch_size "
                         "or max_new_tokens, or set rollout.vllm_gpu_memory")
    return max(share, 0.05)
