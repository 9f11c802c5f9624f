"""The memory planner against what the library actually allocates on the tiny model, and its arithmetic."""

import pytest

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
    assert plan.peak == plan.static + max(plan.rollout, plan.training)
    assert plan.fits(200 * 2**30) and not plan.fits(10 * 2**30)
    smaller = plan_memory("Qwen2.5-7B", micro_batch=1, rollout_batch=16)
    assert smaller.peak < plan.peak
    ckpt, full = plan_memory("Qwen2.5-7B"), plan_memory("Qwen2.5-7B", gradient_checkpointing=False)
    acts = lambda p: _part(p, "training: activations")  # noqa: E731
    assert acts(full) > 10 * acts(ckpt)
    # the logits in bf16 plus one float32 chunk (2 x 1 GiB): the full float32 copies never exist
    T = 8 * (256 + 4096)  # the defaults' micro-batch x sequence
    assert _part(plan, "training: logits") == T * 152064 * 2 + 2 * 4 * 2**28
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
    need = sum(v for k, v in plan.parts.items() if k.startswith(("weights:", "LoRA r=", "rollout:")))
    share = vllm_memory_share("Qwen2.5-7B", gpu, rollout_batch=64, max_model_len=1024)
    assert share * gpu >= (need + VLLM_RUNTIME_BYTES) * 1.15 > (share - 0.01) * gpu  # rounded up to 0.01
    assert vllm_memory_share("Qwen2.5-7B", gpu, rollout_batch=256, max_model_len=1024) > share
    assert vllm_memory_share("qwen2-tiny", gpu, rollout_batch=4, max_model_len=64) == 0.05  # the floor
    with pytest.raises(ValueError, match="rollout.batch_size = 4096 x 8192 tokens"):
        vllm_memory_share("Qwen2.5-32B", gpu, rollout_batch=4096, max_model_len=8192)
