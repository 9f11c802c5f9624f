"""The humming-kernels path: status, the per-weight cache, the fallback, and (GPU) correctness.

CPU tests fake the library where they need it; GPU tests run at real Qwen2.5 layer shapes
against the fp32 reference and skip without CUDA and humming-kernels.
"""

import warnings

import pytest
import torch

from qerl_kit import kernels, nvfp4
from qerl_kit.kernels import nvfp4_humming as hm
from qerl_kit.kernels.reference import nvfp4_linear_ref

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_state():
    hm._reset_for_tests()
    kernels._forget_routes()
    yield
    hm._reset_for_tests()
    kernels._forget_routes()


def weight(n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = nvfp4.quantize(torch.randn(n, k, generator=g) * 0.02)
    return q.packed.to(device), q.scales.to(device), q.global_scale.to(device)


def test_status_says_why_humming_is_off(monkeypatch):
    import importlib.metadata

    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)

    hm._static_status.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", version)
    assert hm.humming_status() == (False, "humming-kernels is not installed (pip install 'qerl_kit[gpu]')")
    hm._static_status.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.1")
    assert hm.humming_status() == (False, "humming-kernels 0.2.1 is outside the supported range >=0.1.10,<0.2.0")
    hm._static_status.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.19")
    if not CUDA:
        assert hm.humming_status() == (False, "no CUDA device")
    hm._static_status.cache_clear()
    assert hm._version_tuple("0.1.10") < hm._version_tuple("0.1.19") < hm._version_tuple("0.2.0.dev1")


class FakeGemm:
    """Stands in for HummingGemm on the CPU: the reference product, counting builds."""

    built = 0

    def __init__(self, packed, scales, global_scale, dtype):
        FakeGemm.built += 1
        self.w = (packed.clone(), scales.clone(), global_scale.clone())  # as humming: its own copy
        self.dtype = dtype

    def __call__(self, x):
        return nvfp4_linear_ref(x, *self.w)


def test_cache_keeps_one_gemm_per_weight_and_rebuilds_after_a_write_or_a_new_tensor(monkeypatch):
    monkeypatch.setattr(hm, "humming_status", lambda: (True, "faked"))
    monkeypatch.setattr(hm, "HummingGemm", FakeGemm)
    FakeGemm.built = 0
    p, s, g = weight(64, 128)
    a = hm.gemm_for(p, s, g, torch.bfloat16)
    assert hm.gemm_for(p, s, g, torch.bfloat16) is a and hm.cached(p, torch.bfloat16) is a and FakeGemm.built == 1
    assert hm.gemm_for(p, s, g, torch.float16) is not a and FakeGemm.built == 2     # one per dtype
    p.copy_(weight(64, 128, seed=1)[0])               # an in-place write (load_state_dict does this)
    assert hm.cached(p, torch.bfloat16) is None
    assert hm.gemm_for(p, s, g, torch.bfloat16) is not a and FakeGemm.built == 3
    q = p.clone()                                      # another tensor: its own entry
    assert hm.cached(q, torch.bfloat16) is None
    hm.gemm_for(q, s, g, torch.bfloat16)
    entries = len(hm._cache)
    del q                                              # the entry goes with its tensor
    assert len(hm._cache) == entries - 1


def test_a_failing_shape_falls_back_alone_with_one_warning(monkeypatch):
    monkeypatch.setattr(hm, "_static_status", lambda: (True, "faked"))

    def broken(packed, *args, **kwargs):
        if packed.shape[0] == 64:
            raise AssertionError("shape_k must be a multiple of 128")
        return FakeGemm(packed, *args)

    monkeypatch.setattr(hm, "HummingGemm", broken)
    p, s, g = weight(64, 128)
    with pytest.warns(RuntimeWarning, match=r"humming-kernels cannot take this layer shape \(building a \[64 x 128\] "
                                            r"bfloat16 layer failed: AssertionError: shape_k must be a multiple of 128\)"):
        assert hm.gemm_for(p, s, g, torch.bfloat16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no second warning for the shape
        assert hm.gemm_for(*weight(64, 128, seed=2), torch.bfloat16) is None
        assert isinstance(hm.gemm_for(*weight(32, 128), torch.bfloat16), FakeGemm)   # other shapes build
    assert not hm.shape_ok(64, 128, torch.bfloat16) and hm.shape_ok(64, 128, torch.float16)
    assert hm.humming_status() == (True, "faked")


def test_a_missing_library_turns_humming_off_for_the_process(monkeypatch):
    monkeypatch.setattr(hm, "_static_status", lambda: (True, "faked"))

    def broken(*args, **kwargs):
        raise ImportError("No module named 'humming'")

    monkeypatch.setattr(hm, "HummingGemm", broken)
    with pytest.warns(RuntimeWarning, match=r"humming-kernels is off for this process \(building a \[64 x 128\] "
                                            r"bfloat16 layer failed: ImportError: No module named 'humming'\)"):
        assert hm.gemm_for(*weight(64, 128), torch.bfloat16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hm.gemm_for(*weight(32, 128), torch.bfloat16) is None
    assert hm.humming_status()[0] is False and "ImportError" in hm.humming_status()[1]
    assert hm.compile_shapes([(64, 128)]) == {}


def test_only_shapes_the_table_can_send_to_humming_are_compiled(monkeypatch):
    seen = []
    monkeypatch.setattr(hm, "compile_shapes", lambda shapes, *a, **k: seen.append(list(shapes)) or {})
    kernels.compile_shapes([(64, 64), (512, 3584), (1024, 8192), (4608, 3584), (55296, 5120)])
    assert seen == [[(4608, 3584), (55296, 5120)]]     # tiny and k/v layers (<= 8M weights) stay on ours
    assert kernels.compile_shapes([(64, 64)]) == {} and len(seen) == 1


def test_dispatcher_humming_branch_adds_bias_keeps_shape_and_falls_back(monkeypatch):
    """The dispatcher's humming path on CPU with a fake library: bias, 3-D input; then a failing
    build falls back to the next row of the table within the same call."""
    monkeypatch.setattr(hm, "humming_status", lambda: (True, "faked"))
    monkeypatch.setattr(hm, "HummingGemm", FakeGemm)
    monkeypatch.setattr(kernels, "_route", lambda op, x2, p, s, choice, fmt="nvfp4": "humming" if hm.shape_ok(
        p.shape[0], p.shape[1] * 2, x2.dtype) else "reference")
    p, s, g = weight(64, 128)
    bias = torch.randn(64)
    x = torch.randn(2, 3, 128)
    y = kernels.nvfp4_linear(x, p, s, g, bias)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y, nvfp4_linear_ref(x, p, s, g, bias))

    def broken(*args, **kwargs):
        raise ValueError("schema")

    hm._reset_for_tests()
    kernels._forget_routes()
    monkeypatch.setattr(hm, "HummingGemm", broken)
    monkeypatch.setattr(hm, "humming_status", lambda: (hm._disabled is None, hm._disabled or "faked"))
    with pytest.warns(RuntimeWarning, match="schema"):
        y = kernels.nvfp4_linear(x, p, s, g, bias)
    torch.testing.assert_close(y, nvfp4_linear_ref(x, p, s, g, bias))


# -- GPU: real shapes -----------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA or not hm.humming_status()[0],
                         reason=f"needs humming-kernels on a GPU: {hm.humming_status()[1]}")
SHAPES = [(4608, 3584), (3584, 18944), (55296, 5120)]   # 7B fused qkv, 7B down, 32B fused gate_up


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
def test_humming_matches_the_reference_at_real_shapes(n, k):
    p, s, g = weight(n, k, "cuda")
    gemm = hm.HummingGemm(p, s, g, torch.bfloat16)
    for m in (1, 3, 8, 33, 64, 100, 256, 512, 1000, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = nvfp4_linear_ref(x.float(), p, s, g)
        if m <= 1023:                                     # where the table may send humming
            err = ((gemm(x).float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (m, err)                   # bf16 output: 2e-3..4e-3 measured
        routed = kernels.nvfp4_linear(x, p, s, g).float()
        assert ((routed - ref).norm() / ref.norm()).item() < 1e-2, (m, kernels.route("forward", x, p, s))


@gpu
@pytest.mark.gpu
def test_routed_layer_in_a_graph_equals_eager_and_trains():
    from qerl_kit.linear import NVFP4Linear

    lin = torch.nn.Linear(3584, 4608, bias=True, device="cuda", dtype=torch.bfloat16)
    q = NVFP4Linear.from_linear(lin)
    x = torch.randn(8, 3584, device="cuda", dtype=torch.bfloat16)
    assert kernels.route("forward", x, q.packed, q.scales) == "humming"
    eager = q(x)
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = q(static)
    graph.replay()
    torch.cuda.synchronize()

    def close(a, b):  # bf16 outputs of ~1: a few ulps apart where the kernel's split-K adds in another order
        # (seen on the H200: 2 of 36864 elements 0.023 apart); a replay on stale input is ~1.4 apart
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 1e-2 and (a.float() - b.float()).abs().max().item() < 6e-2, rel

    close(out, eager)
    fresh = torch.randn_like(x)
    static.copy_(fresh)
    graph.replay()
    close(out, q(fresh))
    # the training path: 3-D input that needs a gradient; dx from our dgrad kernel
    x3 = torch.randn(2, 4, 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = q(x3)
    ref = nvfp4_linear_ref(x3.detach().float(), q.packed, q.scales, q.global_scale, q.bias)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    y.backward(torch.ones_like(y))
    w = q.dequantized_weight(torch.float32)
    dref = torch.ones(2, 4, 4608, device="cuda") @ w
    assert ((x3.grad.float() - dref).norm() / dref.norm()).item() < 1e-2


@gpu
@pytest.mark.gpu
def test_gpu_fallback_to_our_kernels_when_a_build_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(hm, "HummingGemm", broken)
    p, s, g = weight(4608, 3584, "cuda")
    x = torch.randn(8, 3584, device="cuda", dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no compiler"):
        y = kernels.nvfp4_linear(x, p, s, g)
    assert kernels.route("forward", x, p, s) != "humming"
    torch.testing.assert_close(y, kernels.nvfp4_linear(x, p, s, g, backend="ours"))


@gpu
@pytest.mark.gpu
def test_engine_decodes_through_humming_with_the_models_logprobs():
    """A 2-layer model with 7B-sized widths, NVFP4 + LoRA, on the GPU engine (CUDA graphs): its fused
    q/k/v and gate/up take humming, and each sampled token's log-prob is the HF forward's."""
    from qerl_kit.rollout import StaticEngine
    from qerl_kit.lora import attach_lora
    from qerl_kit.models import build_model
    from qerl_kit.quantize import quantize_model
    from qerl_kit.rollout import SamplingParams

    model = build_model("qwen2-tiny", dtype=torch.bfloat16, device="cuda", hidden_size=3584,
                        intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4)
    quantize_model(model, "nvfp4")
    model = attach_lora(model, r=8, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (L,), generator=gen).tolist() for L in (7, 12, 9, 12)]
    engine = StaticEngine(model)
    out = engine.generate_ids(prompts, n=2, sampling=SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
                              ignore_eos=True)
    plan = engine.decoder.plan
    assert plan is not None and engine.decoder.path == "fused"
    qkv, gate_up = plan.layers[0].qkv, plan.layers[0].gate_up
    x = torch.empty(8, 3584, device="cuda", dtype=torch.bfloat16)
    assert kernels.route("forward", x, qkv.packed, qkv.scales) == "humming"
    assert kernels.route("forward", x, gate_up.packed, gate_up.scales) == "cuda_decode"  # K < 5120, >= 72M weights
    assert kernels.route("forward", torch.cat([x, x]), gate_up.packed, gate_up.scales) == "humming"
    assert hm.cached(qkv.packed, torch.bfloat16) is not None     # built during the warm-up, not in a capture
    for row in range(8):
        prompt, completion = prompts[row // 2], out.completion_ids[row].tolist()
        ids = torch.tensor([prompt + completion], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion, device="cuda")[:, None]).squeeze(1)
        # bf16 activations, and different kernels (humming in the graphs, the dense path in the forward)
        torch.testing.assert_close(out.logprobs[row].to(want.device), want, atol=0.15, rtol=0.05)
