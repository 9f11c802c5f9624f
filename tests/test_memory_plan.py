"""The memory planner against what the library actually allocates on the tiny model, and its arithmetic."""

import pytest
import torch

from qerl_kit.memory_plan import _PROJECTIONS as _PROJ
from qerl_kit.memory_plan import model_shape, plan_memory


def _part(plan, prefix):
    return next(v for k, v in plan.parts.items() if k.startswith(prefix))


@pytest.fixture(scope="module")
def tiny():
    from qerl_kit.models import build_model
    from qerl_kit.quantize import memory_report, quantize_model

    model = build_model("qwen2-tiny", hidden_size=128, intermediate_size=256)
    report = quantize_model(model, fmt="nvfp4")
    return model, report, memory_report(model)


def test_weight_bytes_match_the_quantized_model(tiny):
    model, report, mem = tiny
    plan = plan_memory(model.config, fmt="nvfp4", lora_r=4)
    assert _part(plan, "weights: projections") == report.bytes_after  # exact: codes + fp8 scales + global
    dense_fp32 = mem.dense_by_dtype["float32"]  # the planner counts bf16: half the fp32 bytes
    assert _part(plan, "weights: embeddings") == pytest.approx(dense_fp32 / 2, rel=0.02)  # + rotary buffer


def test_lora_parameter_count_matches_peft(tiny):
    from qerl_kit.lora import attach_lora, trainable_parameters

    model, _, _ = tiny
    plan = plan_memory(model.config, lora_r=4, lora_bytes=4)
    policy = attach_lora(model, r=4)
    try:
        assert _part(plan, "LoRA r=4") == trainable_parameters(policy)["trainable"] * 4
    finally:
        policy.unload()


def test_kv_cache_and_bf16_arithmetic_for_qwen25_7b():
    s = model_shape("Qwen2.5-7B")
    assert (s["layers"], s["kv_heads"], s["head_dim"], s["tied"]) == (28, 4, 128, False)
    plan = plan_memory("Qwen2.5-7B", rollout_batch=1, prompt_len=0, max_new_tokens=1)
    assert _part(plan, "rollout: KV cache") == 2 * 28 * 4 * 128 * 2  # 56 KiB per token
    nv, bf = plan_memory("Qwen2.5-7B"), plan_memory("Qwen2.5-7B", fmt="none")
    ratio = _part(bf, "weights: projections") / _part(nv, "weights: projections")
    assert ratio == pytest.approx(16 / 4.5, rel=1e-3)
    assert 3.5e9 < _part(nv, "weights: projections") < 3.8e9  # 6.5 B projection weights at 4.5 bits

    per_tok = 2 * 28 * 4 * 128 * 2
    grouped = plan_memory("Qwen2.5-7B", rollout_batch=64, prompt_len=256, max_new_tokens=512, group_size=8)
    assert _part(grouped, "rollout: KV cache") == (8 * 256 + 64 * 512) * per_tok  # the prompt once per group
    with pytest.raises(ValueError, match="group_size must be an int >= 1 that divides rollout_batch"):
        plan_memory("Qwen2.5-7B", rollout_batch=64, group_size=5)


def test_peak_is_static_plus_the_larger_phase_and_fits():
    plan = plan_memory("Qwen2.5-7B", overhead=0.0)
    assert plan.kept and all(k.startswith("rollout:") for k in plan.kept)  # keep_cache: the KV cache stays
    assert plan.peak == plan.allocated == plan.static + max(plan.rollout, plan.training + plan.kept_bytes)
    freed = plan_memory("Qwen2.5-7B", overhead=0.0, keep_cache=False)
    assert not freed.kept and freed.peak == freed.static + max(freed.rollout, freed.training)
    assert plan_memory("Qwen2.5-7B").peak == int(plan.allocated * 1.1)
    assert plan.fits(200 * 2**30) and not plan.fits(10 * 2**30)
    smaller = plan_memory("Qwen2.5-7B", micro_batch=1, rollout_batch=16)
    assert smaller.peak < plan.peak
    ckpt, full = plan_memory("Qwen2.5-7B"), plan_memory("Qwen2.5-7B", gradient_checkpointing=False)
    acts = lambda p: _part(p, "training: activations")  # noqa: E731
    assert acts(full) > 10 * acts(ckpt)
    # the logits in bf16 (every position), the completion positions' gradient and one chunk's
    # zero-padded one; the float32 log-softmax one chunk of CHUNK_ELEMS at a time, never whole
    T = 8 * (256 + 4096)  # the defaults' micro-batch x sequence
    assert _part(plan, "training: logits") == (T + 2 * 8 * 4096) * 152064 * 2
    positions = 2**28 // (8 * 152064)
    assert _part(plan, "training: one float32 log-prob chunk") == 18 * 8 * positions * 152064 <= 18 * 2**28
    assert "Qwen2.5-7B" in str(plan) and "<table" in plan._repr_html_()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown model preset"):
        plan_memory("Qwen9-1B")
    with pytest.raises(ValueError, match="targets: .qkv. matches no LoRA target"):
        plan_memory("Qwen2.5-7B", targets=("qkv",))
    with pytest.raises(ValueError, match="optimizer"):
        plan_memory("Qwen2.5-7B", optimizer="sgd")
    with pytest.raises(ValueError, match="GPU's memory"):
        plan_memory("Qwen2.5-7B").fits()


def test_vllm_memory_share_counts_weights_adapter_kv_and_runtime():
    from qerl_kit.memory_plan import VLLM_RUNTIME_BYTES, plan_memory, vllm_memory_share

    gpu = 141 * 10**9
    plan = plan_memory("Qwen2.5-7B", "nvfp4", 32, rollout_batch=64, prompt_len=0, max_new_tokens=1024)
    # vLLM's own: weights, adapter, KV cache and one step's float32 logits (not our engine's buffers)
    need = sum(v for k, v in plan.parts.items() if k.startswith(("weights:", "LoRA r=", "rollout: KV cache")))
    need += 64 * 152064 * 4
    share = vllm_memory_share("Qwen2.5-7B", gpu, rollout_batch=64, max_model_len=1024)
    assert share * gpu >= (need + VLLM_RUNTIME_BYTES) * 1.15 > (share - 0.01) * gpu  # rounded up to 0.01
    assert vllm_memory_share("Qwen2.5-7B", gpu, rollout_batch=256, max_model_len=1024) > share
    assert vllm_memory_share("qwen2-tiny", gpu, rollout_batch=4, max_model_len=64) == 0.05  # the floor
    with pytest.raises(ValueError, match="rollout.batch_size = 4096 x 8192 tokens"):
        vllm_memory_share("Qwen2.5-32B", gpu, rollout_batch=4096, max_model_len=8192)


# ---- the terms the plan adds up, against what the code allocates ------------------------------------
def test_kv_cache_and_fused_copy_match_the_static_engine(tiny):
    """The KV cache and the fused q/k/v + gate/up copy are the bytes the StaticEngine allocates."""
    from qerl_kit.rollout import SamplingParams, StaticEngine

    model, _, _ = tiny
    engine = StaticEngine(model, cuda_graphs=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (9, 70, 33)]  # padded to 128
    engine.generate_ids(prompts, 4, SamplingParams(max_new_tokens=5, temperature=1.0, seed=1), ignore_eos=True)
    cache = engine._state[1].cache
    plan = plan_memory(model.config, lora_r=4, rollout_batch=12, group_size=4, prompt_len=70, max_new_tokens=5,
                       micro_batch=4, kv_bytes=4)  # the CPU model is float32
    assert _part(plan, "rollout: KV cache") == cache.nbytes
    groups = [grp for lp in engine.decoder.plan.layers for grp in lp.groups if len(grp.bases) > 1]
    # the codes and scales as they are; the q/k/v bias counted in bf16, the model's dtype on a GPU
    copied = sum(t.numel() * (2 if name == "bias" else t.element_size()) for grp in groups
                 for name, t in grp.fused.items())
    assert _part(plan, "engine: fused q/k/v + gate/up copy") == copied
    s = model_shape(model.config)
    solo = plan_memory(model.config, lora_r=4, rollout_batch=12, group_size=1, prompt_len=70, max_new_tokens=5)
    per_token = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * 2
    assert _part(solo, "rollout: KV cache") == 12 * (128 + 5) * per_token  # every row its own (padded) prompt


def test_which_parts_each_setting_brings():
    """The fused copy only where the fused plan runs (StaticEngine, fused=True), humming's repack only for NVFP4, the
    engine's state and CUDA-graph streams only for the StaticEngine, the dense cache only when asked."""
    def names(**kw):
        return " | ".join(plan_memory("Qwen2.5-7B", **kw).parts)

    assert all("engine: fused" in names(fmt=f) for f in ("nvfp4", "none", "nf4", "mxfp4"))
    assert "engine: fused" not in names(fused=False) and "engine: fused" not in names(engine="hf")
    assert "humming" in names() and "humming" not in names(humming=False) and "humming" not in names(fmt="mxfp4")
    assert "decode state" not in names(engine="hf") and "(1 streams" in names(engine="hf")
    assert "dense weight cache" not in names() and "dense weight cache" in names(dense_cache_bytes=2**30)
    with pytest.raises(ValueError, match="engine must be one of"):
        plan_memory(engine="vllm")
    with pytest.raises(ValueError, match="dense_cache_bytes must be"):
        plan_memory(dense_cache_bytes=-1)


def test_humming_and_dense_cache_sizes_for_qwen25_7b():
    """7B, fused decode: humming repacks the fused q/k/v and gate/up buffers and o/down (every
    projection's 4-bit bytes once: k/v alone are below its 8M-weight rows); with the generic path the
    model's own q/o/gate/up/down (not k/v). ``dense_cache_bytes="all"``: every projection in bf16."""
    s = model_shape("Qwen2.5-7B")
    h, i, kv = s["hidden"], s["inter"], s["kv_heads"] * s["head_dim"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    assert _part(plan_memory("Qwen2.5-7B"), "kernels: humming") == 28 * (per_layer // 2 + per_layer // 16)
    generic = per_layer - 2 * h * kv
    assert _part(plan_memory("Qwen2.5-7B", fused=False), "kernels: humming") == 28 * (generic // 2 + generic // 16)
    plan = plan_memory("Qwen2.5-7B", dense_cache_bytes="all")
    assert _part(plan, "training: dense weight cache") == 28 * per_layer * 2
    assert plan.training - plan_memory("Qwen2.5-7B").training == 28 * per_layer * 2
    assert plan_memory("Qwen2.5-7B", fmt="none", dense_cache_bytes="all").parts.keys() == \
        plan_memory("Qwen2.5-7B", fmt="none").parts.keys()  # nothing to dequantize


def _measured_cases():
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "measured_peaks.json").read_text())
    return [pytest.param(c, data["models"].get(c["model"], c["model"]) if isinstance(c["model"], str) else c["model"],
                         id=f"{c['date']}-{c['name'][:40]}",
                         marks=[pytest.mark.xfail(strict=True, reason=c["over_plan"])] if "over_plan" in c else [])
            for c in data["cases"]]


@pytest.mark.parametrize("case,model", _measured_cases())
def test_plan_bounds_every_measured_peak(case, model):
    """The plan is at least every measured max_memory_allocated() (tests/data/measured_peaks.json) and
    at most 1.5x it. The upper check uses the parts the code of that run allocated (``absent_then``:
    the engine's own fused copy and humming's repack arrived after some runs); the current plan,
    with them, is checked from below too. Achieved: 1.03-1.27x (docs/training.md, "Memory"); a case
with ``over_plan`` is a known gap, a strict expected failure until the plan bounds it."""
    plan = plan_memory(model, **case["settings"])
    measured = case["measured_gib"] * 2**30
    absent = tuple(case.get("absent_then", ()))
    then = plan.allocated - sum(v for k, v in plan.parts.items() if absent and k.startswith(absent) and k not in plan.kept)
    assert measured <= then <= plan.allocated, (case["name"], then / measured)
    assert then <= 1.5 * measured, (case["name"], then / measured)


# ---- on a GPU: the bound against the CUDA allocator's counter ----------------------------------------
CUDA = torch.cuda.is_available()


def _humming_usable() -> bool:
    from qerl_kit.kernels.nvfp4_humming import humming_status

    return humming_status()[0]


@pytest.mark.skipif(not CUDA or not _humming_usable(), reason="needs a CUDA GPU with humming-kernels")
def test_humming_repack_is_the_planned_bytes():
    """humming's repacked weight costs what the plan counts per weight: the codes and scales again."""
    from qerl_kit.kernels.nvfp4_humming import HummingGemm

    n, k = 4608, 3584  # 7B's fused q/k/v
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // 16, device="cuda") * 300 + 8).to(torch.float8_e4m3fn)
    gemm = HummingGemm(packed, scales, torch.ones(1, device="cuda"))
    assert n * k // 2 + n * k // 16 == pytest.approx(gemm.nbytes, rel=0.01)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: the plan bounds torch.cuda.max_memory_allocated()")
def test_plan_bounds_grpo_steps_measured_here(tmp_path):
    """Two GRPO steps of a random 0.5B-shaped NVFP4 policy (bench.bench_memory): the measured peak is
    below the plan (the upper bound). The ratio is the table's; at this small shape the 1.06 GiB of
    cuBLAS workspaces the plan counts for a long run dominate, so no 1.5x check here."""
    import json

    from bench.bench_memory import main

    main(["--models", "0.5B", "--formats", "nvfp4", "--prompts", "2", "--group", "4", "--prompt", "64", "--new", "128",
          "--micro-batch", "4", "--steps", "2", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "memory.json").read_text())["rows"][0]
    assert "error" not in row, row
    assert 0 < row["measured_gib"] <= row["plan_gib"], row


def test_layer_activations_bound_what_autograd_saves():
    """What a training forward of an NVFP4 + LoRA model in bf16 keeps for backward (autograd's saved
    tensors, parameters left out) is at most the plan's per-layer count for every layer plus the final
    norm's, and not far below it (SDPA here saves no score matrix, as on the GPU)."""
    from qerl_kit import memory_terms
    from qerl_kit.lora import attach_lora
    from qerl_kit.models import build_model
    from qerl_kit.quantize import quantize_model

    torch.manual_seed(0)
    model = build_model("qwen2-tiny", hidden_size=128, intermediate_size=256, dtype=torch.bfloat16)
    quantize_model(model, fmt="nvfp4")
    policy = attach_lora(model, r=4)
    policy.train()
    params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    B, L = 2, 96
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy(input_ids=torch.randint(1, 500, (B, L)), use_cache=False)
    s = model_shape(model.config)
    per_token = memory_terms._layer_saved_per_token(s, list(_PROJ), dict(act_bytes=2, lora_r=4, lora_bytes=2))
    bound = B * L * (s["layers"] * per_token + 4 * s["hidden"] + 2 * s["hidden"])  # + the final norm's
    total = sum(saved.values())
    assert 0.7 * bound < total <= bound, (total, bound)


def test_every_row_count_a_step_sends_to_the_models_own_layers_is_one_the_plan_counts(tmp_path, monkeypatch):
    """humming-kernels keeps a repacked copy of every weight it sees, so the plan's humming term lists
    the row counts each weight meets (memory_terms._row_ranges): the model's own q/k/v and gate/up only
    in prefill chunks and micro-batches (the engine decodes its fused copy), o/down also in decode. One
    whole GRPO step of the StaticEngine with AQN, every call of a model layer recorded: none outside.
    (AQN's probe forward once called every layer with 4 rows: at 32B on a GPU that repacked the
    policy's gate/up, 9.5 GiB nothing counted.)"""
    from bench.step_group import build_policy, forced_static, make_task, trainer_for
    from qerl_kit.linear import NVFP4Linear
    from qerl_kit.memory_terms import _row_ranges

    P, C, rows, group, micro = 64, 16, 16, 4, 4
    peft, tok = build_policy("qwen2-tiny", "nvfp4", "cpu", 4)
    seen = []
    forward = NVFP4Linear.forward

    def recorded(self, x):
        seen.append((self._probe_name, x.reshape(-1, self.in_features).shape[0]))
        return forward(self, x)

    for name, m in peft.named_modules():
        if isinstance(m, NVFP4Linear):
            m._probe_name = name.rsplit(".", 2)[-2] if name.endswith("base_layer") else name.rsplit(".", 1)[-1]
    monkeypatch.setattr(NVFP4Linear, "forward", recorded)
    a = dict(prompts=rows // group, group=group, prompt_len=P, lora_r=4, steps=1, keep_cache=True, max_rows=rows,
             dense_cache="auto", max_new_tokens=C)
    case = dict(model="qwen2-tiny", format="nvfp4", engine="static", gradient_checkpointing=True, mu=1,
                micro_batch=micro, seed=0, aqn=True)
    engine = forced_static(peft, tok, ignore_eos=True, keep_cache=True, max_rows=rows)
    engine.lengths = [C] * rows
    trainer = trainer_for(peft, tok, make_task("qwen2-tiny", peft, P, rows, 0), engine, case, a, C, tmp_path)
    trainer.train_step()
    ranges = _row_ranges(dict(rollout_batch=rows, group_size=group, micro_batch=micro, prompt_len=P,
                              max_new_tokens=C, engine="static"))
    own = ranges["prefill"] + ranges["train"]
    inside = lambda m, spans: any(lo <= m <= hi for lo, hi in spans)  # noqa: E731
    assert seen and {name for name, _ in seen} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}
    outside = sorted({(name, m) for name, m in seen
                      if not inside(m, own + (ranges["decode"] if name in ("o_proj", "down_proj") else []))})
    assert not outside, f"row counts no plan term counts: {outside}; the plan's ranges: {ranges}"
