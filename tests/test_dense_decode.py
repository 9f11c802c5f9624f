"""The StaticEngine's dense decode copies (``dense_decode``): which groups get one (the measured rows of
``kernels.routes.DENSE_DECODE``), that decoding on one samples what the 4-bit weights sample, that it
follows a changed base weight, and that the memory plan counts it."""

import pytest
import torch

from qerl_kit.kernels import routes
from qerl_kit.lora import attach_lora
from qerl_kit.memory_plan import plan_memory
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout import SamplingParams, StaticEngine

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DENSE_PART = "engine: dense decode copies of small 4-bit groups (bf16)"


def test_the_rule_takes_the_small_models_groups_at_the_measured_rows_only():
    qkv05, gate_up05, qkv7 = (1152, 896), (9728, 896), (4608, 3584)  # Qwen2.5-0.5B and 7B fused groups
    assert routes.dense_decode(64, *qkv05) and routes.dense_decode(8, *qkv05)
    assert not routes.dense_decode(1, *qkv05) and not routes.dense_decode(4, *qkv05)  # 1-4 rows: NVFP4 ties or wins
    assert routes.dense_decode(64, *gate_up05) and not routes.dense_decode(8, *gate_up05)  # humming wins at 8
    assert routes.dense_decode(64, *qkv7) and routes.dense_decode(256, 3584, 3584)  # 7B q/k/v and o from 64 rows
    assert not routes.dense_decode(32, *qkv7) and not routes.dense_decode(8, *qkv7)  # below: the 4-bit kernels
    assert not routes.dense_decode(64, 37888, 3584) and not routes.dense_decode(256, 3584, 18944)  # 7B gate/up, down
    assert not routes.dense_decode(128, 5120, 5120)  # 14B q/o: its copy would cost more memory than it saves time
    assert not routes.dense_decode(64, *qkv05, fmt="nf4")  # NF4 / MXFP4 not measured
    assert not routes.dense_decode(64, *qkv05, dtype=torch.float32)
    assert not routes.dense_decode(32, *gate_up05) and routes.dense_decode(5, *qkv05)  # the rows' edges
    assert not routes.dense_decode(63, *qkv7)
    # the groups the engine holds a copy of: some row count takes them
    assert routes.dense_decode_held(*gate_up05) and routes.dense_decode_held(*qkv05) and routes.dense_decode_held(*qkv7)
    assert not routes.dense_decode_held(5120, 5120) and not routes.dense_decode_held(37888, 3584)
    assert not routes.dense_decode_held(*qkv05, fmt="nf4")


def _policy(seed=1):
    dtype = torch.bfloat16 if CUDA else torch.float32
    model = build_model("qwen2-tiny", seed=seed, dtype=dtype, device=DEVICE)
    quantize_model(model, "nvfp4")
    model = attach_lora(model, r=4, seed=seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def _bases(layer):
    attn, mlp = layer.self_attn, layer.mlp
    return [m.get_base_layer() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                          mlp.up_proj, mlp.down_proj)]


def test_a_dense_copy_is_the_exact_dequantization_and_samples_what_the_packed_weights_sample():
    model = _policy()
    on, off = StaticEngine(model, dense_decode="on"), StaticEngine(model, dense_decode="off")
    plan = on.decoder.plan
    q, k, v, o, gate, up, down = _bases(on.decoder.layers[0])
    expect = {"qkv": torch.cat([b.dequantized_weight(q.compute_dtype) for b in (q, k, v)]),
              "o": o.dequantized_weight(o.compute_dtype), "down": down.dequantized_weight(down.compute_dtype),
              "gate_up": torch.cat([gate.dequantized_weight(gate.compute_dtype), up.dequantized_weight(up.compute_dtype)])}
    for name, w in expect.items():
        assert torch.equal(getattr(plan.layers[0], name).dense_weight, w), name
    assert all(g.dense_weight is None for lp in off.decoder.plan.layers for g in lp.groups)
    if not CUDA:  # auto holds copies on CUDA only, where the rule was measured
        auto = StaticEngine(model)
        assert all(g.dense_weight is None for lp in auto.decoder.plan.layers for g in lp.groups)
    prompts = torch.randint(3, 500, (3, 7), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    a = on.generate_ids(prompts, 2, sp, ignore_eos=True)
    b = off.generate_ids(prompts, 2, sp, ignore_eos=True)
    tol = 2e-3 if not CUDA else 6e-2
    if torch.equal(a.completion_ids, b.completion_ids):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=tol, rtol=0)
    else:  # bf16 rounding may flip a near tie on the GPU
        assert CUDA
    with torch.no_grad():  # the decode steps read the copies: scaled, they sample another policy
        for lp in plan.layers:
            for g in lp.groups:
                g.dense_weight.mul_(3.0)
    c = on.generate_ids(prompts, 2, sp, ignore_eos=True)
    assert not torch.allclose(a.logprobs[:, 1:], c.logprobs[:, 1:], atol=0.1)  # token 0 comes from the prefill
    assert torch.allclose(a.logprobs[:, 0], c.logprobs[:, 0])


def test_a_dense_copy_follows_a_changed_base_weight():
    model, donor = _policy(seed=1), _policy(seed=2)
    engine = StaticEngine(model, dense_decode="on")
    layer = engine.decoder.plan.layers[0]
    held = layer.qkv.dense_weight
    sp = SamplingParams(max_new_tokens=3, temperature=0)
    first = engine.generate_ids([[5, 6, 7, 8]], 1, sp, ignore_eos=True)
    k = _bases(engine.decoder.layers[0])[1]
    with torch.no_grad():  # a reloaded base weight: the k projection's codes and scales of another model
        k.packed.copy_(_bases(donor.base_model.model.model.layers[0])[1].packed)
        k.scales.copy_(_bases(donor.base_model.model.model.layers[0])[1].scales)
    again = engine.generate_ids([[5, 6, 7, 8]], 1, sp, ignore_eos=True)  # refresh() runs at its start
    q, k, v = _bases(engine.decoder.layers[0])[:3]
    assert layer.qkv.dense_weight is held  # copied in place: captured graphs keep reading it
    assert torch.equal(held, torch.cat([b.dequantized_weight(q.compute_dtype) for b in (q, k, v)]))
    fresh = StaticEngine(model, dense_decode="off").generate_ids([[5, 6, 7, 8]], 1, sp, ignore_eos=True)
    assert torch.equal(again.completion_ids, fresh.completion_ids)
    assert not torch.allclose(first.logprobs, again.logprobs)


def test_a_bad_setting_is_refused_naming_the_allowed_values():
    with pytest.raises(ValueError, match=r"dense_decode must be one of \('auto', 'on', 'off'\); got 'yes'"):
        StaticEngine(_policy(), dense_decode="yes")


def test_the_memory_plan_counts_the_copies_the_engine_holds():
    small = plan_memory("Qwen2.5-0.5B", "nvfp4")
    # 0.5B: every group (q/k/v 1152 x 896, o 896 x 896, gate/up 9728 x 896, down 896 x 4864), 24 layers, bf16
    assert small.parts[DENSE_PART] == 24 * 2 * (1152 * 896 + 896 * 896 + 9728 * 896 + 896 * 4864)
    # 7B: q/k/v (4608 x 3584) and o (3584 x 3584); 14B and up: none
    assert plan_memory("Qwen2.5-7B", "nvfp4").parts[DENSE_PART] == 28 * 2 * (4608 * 3584 + 3584 * 3584)
    assert DENSE_PART not in plan_memory("Qwen2.5-14B", "nvfp4").parts
    assert DENSE_PART not in plan_memory("Qwen2.5-0.5B", "none").parts
    assert DENSE_PART not in plan_memory("Qwen2.5-0.5B", "nf4").parts
    # 1.5B: q/k/v (2048 x 1536), o (1536 x 1536) and down (1536 x 8960), not gate/up (17920 x 1536)
    assert plan_memory("Qwen2.5-1.5B", "nvfp4").parts[DENSE_PART] == 28 * 2 * (2048 * 1536 + 1536 * 1536 + 1536 * 8960)


@pytest.mark.skipif(not CUDA, reason="the auto rule and CUDA graphs need a GPU")
def test_gpu_auto_holds_the_small_groups_and_graphs_replay_them_like_eager():
    model = _policy()
    graphs, eager = StaticEngine(model, length_bucket=8), StaticEngine(model, cuda_graphs=False, length_bucket=8)
    assert all(g.dense_weight is not None for lp in graphs.decoder.plan.layers for g in lp.groups)  # tiny widths
    sp = SamplingParams(max_new_tokens=12, temperature=0)
    for prompts, n in (([[5, 6, 7, 8], [9, 10]], 4), ([[11, 12, 13]], 2)):  # 8 rows: dense; 2 rows: 4-bit kernels
        a = graphs.generate_ids(prompts, n, sp, ignore_eos=True)
        b = eager.generate_ids(prompts, n, sp, ignore_eos=True)
        assert torch.equal(a.completion_ids, b.completion_ids), (len(prompts), n)
