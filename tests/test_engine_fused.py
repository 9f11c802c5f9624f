"""The engine's fused decode step: Triton kernels vs their references (CPU interpreter, or the GPU),
and the fused plan vs the generic path on whole models (the plan's copies change nothing in the model).

Like tests/test_kernels.py, the kernel tests need TRITON_INTERPRET=1 before Triton's first import;
in a full run this module re-runs itself in a subprocess with it set.
"""

import pytest
import torch

from tests import triton_interp

IN_PROCESS = triton_interp.enable()  # before Triton's first import

triton = pytest.importorskip("triton", reason="the fused kernels need triton")

from qerl_kit.rollout import StaticEngine  # noqa: E402
from qerl_kit.rollout.static.fused import (add_rmsnorm, add_rmsnorm_ref, rope_to_cache,  # noqa: E402
                                            rope_to_cache_ref, silu_mul, silu_mul_ref)
from qerl_kit.kernels.lora_triton import Tiling, kernels_take, lora_apply_, lora_apply_ref_, lora_shrink  # noqa: E402
from qerl_kit.lora import attach_lora  # noqa: E402
from qerl_kit.models import build_model  # noqa: E402
from qerl_kit.quantize import quantize_model  # noqa: E402
from qerl_kit.rollout import SamplingParams  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def _runnable(request):
    triton_interp.skip_unless_runnable(request, IN_PROCESS, "test_in_an_interpreter_subprocess")


@pytest.mark.skipif(IN_PROCESS, reason="the tests run in this process")
def test_in_an_interpreter_subprocess():
    triton_interp.rerun_in_subprocess(__file__)


def _rand(*shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rmsnorm_matches_reference(dtype, residual):
    gen = torch.Generator().manual_seed(int(residual) + 7)
    x, w = _rand(5, 96, dtype=dtype, gen=gen), _rand(96, dtype=dtype, gen=gen)
    r = _rand(5, 96, dtype=dtype, gen=gen) if residual else None
    out, h = add_rmsnorm(x, r, w, 1e-6, use_triton=True)
    ref_out, ref_h = add_rmsnorm_ref(x, r, w, 1e-6)
    if CUDA or dtype == torch.float32:
        assert torch.equal(h, ref_h)  # the residual add is exact
    else:  # Triton's CPU interpreter truncates float32 -> bf16 casts instead of rounding
        torch.testing.assert_close(h, ref_h, atol=0, rtol=2 ** -7)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_to_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    R, H, KVH, D, L = 3, 4, 2, 16, 9
    qkv = _rand(R, (H + 2 * KVH) * D, dtype=dtype, gen=gen)  # strided views, as the engine has them
    q = qkv[:, :H * D].view(R, H, D)
    k = qkv[:, H * D:(H + KVH) * D].view(R, KVH, D)
    v = qkv[:, (H + KVH) * D:].view(R, KVH, D)
    cos, sin = _rand(R, D, dtype=dtype, gen=gen), _rand(R, D, dtype=dtype, gen=gen)
    slot = torch.tensor([5], device=DEVICE)
    kc, vc = _rand(R, KVH, L, D, dtype=dtype, gen=gen), _rand(R, KVH, L, D, dtype=dtype, gen=gen)
    kc2, vc2 = kc.clone(), vc.clone()
    got = rope_to_cache(q, k, v, cos, sin, kc, vc, slot, use_triton=True)
    want = rope_to_cache_ref(q, k, v, cos, sin, kc2, vc2, slot)
    # exact on the GPU; the CPU interpreter truncates bf16 casts (one ulp per rounding, three here)
    tol = 1e-6 if dtype == torch.float32 else (0 if CUDA else 3 * 2 ** -7)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(kc, kc2, atol=tol, rtol=tol)
    assert torch.equal(vc, vc2)  # v copied bit for bit; every other column untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(4)
    gu = _rand(3, 2 * 1500, dtype=dtype, gen=gen)  # N not a multiple of the block
    tol = 1e-5 if dtype == torch.float32 else (1e-2 if CUDA else 3 * 2 ** -7)  # interpreter: truncating casts
    torch.testing.assert_close(silu_mul(gu, use_triton=True).float(), silu_mul_ref(gu).float(), atol=tol, rtol=tol)


def _policy(preset, fmt, dtype, skip=None):
    model = build_model(preset, seed=1, dtype=dtype, device=DEVICE)
    if fmt != "none":
        quantize_model(model, fmt, skip=skip)
    model = attach_lora(model, r=4, seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("preset, fmt", [(p, f) for p in ("qwen2-tiny", "qwen3-tiny", "llama-tiny") for f in ("nvfp4", "none")]
                         + [("qwen2-tiny", "nf4"), ("qwen2-tiny", "mxfp4")])
def test_fused_step_matches_generic_step_and_leaves_the_model_unchanged(preset, fmt):
    dtype = torch.bfloat16 if CUDA else torch.float32
    model = _policy(preset, fmt, dtype)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    keys = set(model.state_dict())
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    generic = StaticEngine(model, fused=False)
    fused = StaticEngine(model)  # concatenates q/k/v and gate/up into its own buffers
    assert generic.decoder.path.startswith("generic") and fused.decoder.path == "fused"
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after) and set(model.state_dict()) == keys
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs  # the model's storage is untouched
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=2)  # prefill + 3 decode steps: every path
    prompts = ids.tolist()
    a = generic.generate_ids(prompts, 2, sp, ignore_eos=True)
    b = fused.generate_ids(prompts, 2, sp, ignore_eos=True)
    tol = 2e-3 if dtype == torch.float32 else 6e-2
    if torch.equal(a.completion_ids, b.completion_ids):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=tol, rtol=0)
    else:  # bf16 rounding may flip a sample; then the first differing token is a near tie
        assert dtype == torch.bfloat16
    # q/k/v is a copy the plan owns; o_proj (a group of one) is the model's own tensor
    layer, attn = fused.decoder.plan.layers[0], fused.decoder.layers[0].self_attn
    assert layer.qkv.kind == ("dense" if fmt == "none" else fmt)
    attr = "weight" if fmt == "none" else "packed"
    base = attn.q_proj.get_base_layer() if hasattr(attn.q_proj, "get_base_layer") else attn.q_proj
    o_base = attn.o_proj.get_base_layer() if hasattr(attn.o_proj, "get_base_layer") else attn.o_proj
    assert layer.qkv.fused[attr].untyped_storage().data_ptr() != getattr(base, attr).untyped_storage().data_ptr()
    assert torch.equal(layer.qkv.fused[attr][:getattr(base, attr).shape[0]], getattr(base, attr))
    assert layer.o.fused[attr] is getattr(o_base, attr)


def test_fused_nf4_step_runs_the_lut4_kernels_and_matches_the_generic_reference(monkeypatch):
    """The fused step's NF4 q/k/v and gate/up groups go through the routed kernels (forced here, the
    interpreter on the CPU): decode takes the table's rows (4 rows: NF4's dense path, lut4_dense), and
    the tokens and log-probs are the generic path's on the plain-PyTorch reference. float32 on the GPU too (the kernels take it, IEEE products,
    no TF32), so no near tie can flip a sample and the comparison holds everywhere."""
    from qerl_kit import kernels

    model = _policy("qwen2-tiny", "nf4", torch.float32)
    prompts = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)
    with kernels.set_backend("reference"):
        a = StaticEngine(model, fused=False).generate_ids(prompts, 2, sp, ignore_eos=True)
    calls = []
    dense = kernels._LUT4_FORWARD["lut4_dense"]
    monkeypatch.setitem(kernels._LUT4_FORWARD, "lut4_dense",
                        lambda *args: calls.append((args[0].shape[0], args[3])) or dense(*args))
    kernels._forget_routes()
    with kernels.set_backend("triton"):
        engine = StaticEngine(model)
        b = engine.generate_ids(prompts, 2, sp, ignore_eos=True)
    assert engine.decoder.path == "fused" and engine.decoder.plan.layers[0].gate_up.kind == "nf4"
    assert (4, "nf4") in calls and {fmt for _, fmt in calls} == {"nf4"}  # a decode step's 2 x 2 rows
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def test_unsupported_layers_fall_back_to_the_generic_path():
    """q/k/v of two kinds (k_proj left in bf16) cannot be one matmul: the generic path, named."""
    model = _policy("qwen2-tiny", "mxfp4", torch.float32 if not CUDA else torch.bfloat16, skip=("lm_head", "k_proj"))
    engine = StaticEngine(model)
    assert engine.decoder.plan is None and "MXFP4Linear" in engine.decoder.path and "Linear" in engine.decoder.path
    out = engine.generate_ids([[5, 6, 7]], 2, SamplingParams(max_new_tokens=4, seed=0), ignore_eos=True)
    assert out.completion_ids.shape == (2, 4)


def test_fused_model_exports_and_reloads(tmp_path):
    from qerl_kit.export import load_nvfp4, save_nvfp4

    model = build_model("qwen2-tiny", seed=2, device=DEVICE, dtype=torch.bfloat16)
    quantize_model(model, "nvfp4")
    StaticEngine(model)  # the fused plan's copies: the model saves as it would without an engine
    save_nvfp4(model, tmp_path / "ckpt")
    back = load_nvfp4(tmp_path / "ckpt")
    ids = torch.randint(3, 500, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back.to(DEVICE)(input_ids=ids.to(DEVICE)).logits, model(input_ids=ids.to(DEVICE)).logits)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_gpu_graph_replay_equals_eager_and_sees_lora_updates():
    model = _policy("qwen2-tiny", "nvfp4", torch.bfloat16)
    prompts = [[5, 6, 7, 8], [9, 10]]
    sp = SamplingParams(max_new_tokens=20, temperature=0)
    graphs = StaticEngine(model, length_bucket=8)
    eager = StaticEngine(model, cuda_graphs=False, length_bucket=8)
    a = graphs.generate_ids(prompts, 2, sp, ignore_eos=True)
    b = eager.generate_ids(prompts, 2, sp, ignore_eos=True)
    assert torch.equal(a.completion_ids, b.completion_ids)
    with torch.no_grad():  # every projection's adapter: the captured expands read B live
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)
    c = graphs.generate_ids(prompts, 2, sp, ignore_eos=True)  # replayed graphs, new adapter values
    d = eager.generate_ids(prompts, 2, sp, ignore_eos=True)
    assert torch.equal(c.completion_ids, d.completion_ids)
    assert not torch.equal(a.logprobs, c.logprobs)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", ["none", "nf4", "mxfp4", "nvfp4"])
def test_gpu_graphs_survive_batch_shape_changes_in_every_format(fmt):
    # An evaluation's last, smaller chunk gives the engine a new state: its graphs are captured into
    # a fresh pool (capturing into the freed state's pool tripped an allocator assert), and NF4's
    # dequantize must not copy from the host inside a capture.
    model = _policy("qwen2-tiny", fmt, torch.bfloat16)
    sp = SamplingParams(max_new_tokens=12, temperature=0)
    graphs = StaticEngine(model, length_bucket=8)
    eager = StaticEngine(model, cuda_graphs=False, length_bucket=8)
    for prompts, n in (([[5, 6, 7, 8], [9, 10]], 2), ([[11, 12, 13]], 3), ([[5, 6, 7, 8], [9, 10]], 2)):
        a = graphs.generate_ids(prompts, n, sp, ignore_eos=True)
        b = eager.generate_ids(prompts, n, sp, ignore_eos=True)
        assert torch.equal(a.completion_ids, b.completion_ids), (fmt, len(prompts), n)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_gpu_compaction_replays_its_own_graphs_like_eager():
    """Live rows only on the GPU: the views' graphs (captured per row count) give what eager decoding
    of the same compacted batches gives, and the forced lengths come out exactly."""
    model = _policy("qwen2-tiny", "nvfp4", torch.bfloat16)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    lengths = [40, 3, 9, 1, 22, 5, 40, 2]
    sp = SamplingParams(max_new_tokens=40, temperature=0)
    runs = {}
    for graphs in (True, False):
        engine = StaticEngine(model, length_bucket=8, check_every=4, cuda_graphs=graphs)
        runs[graphs] = [engine.generate_ids(prompts, 2, sp, ignore_eos=True, stop_after=lengths) for _ in range(2)]
    for out in runs[True] + runs[False]:
        assert out.completion_mask.sum(1).tolist() == lengths and out.stats["rollout/compactions"] >= 2
    assert torch.equal(runs[True][0].completion_ids, runs[False][0].completion_ids)
    assert torch.equal(runs[True][1].completion_ids, runs[True][0].completion_ids)  # graphs reused
    dense = StaticEngine(model, length_bucket=8, check_every=4, compact=False).generate_ids(
        prompts, 2, sp, ignore_eos=True, stop_after=lengths)
    same = (dense.completion_ids == runs[True][0].completion_ids)[dense.completion_mask.bool()].float().mean()
    assert same > 0.9  # other batch shapes may round bf16 differently; greedy agrees almost everywhere


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_gpu_split_kv_attention_with_a_shared_prefix_matches_sdpa_on_the_plain_layout():
    """The engine's decode attention (Triton split-KV over the shared prompt prefix) against the
    path it replaced (SDPA over every row's copy of the prompt), in graphs, on a bf16 NVFP4 model."""
    model = _policy("qwen2-tiny", "nvfp4", torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 500, (L,), generator=gen).tolist() for L in (70, 5, 33)]  # two prompt blocks
    sp = SamplingParams(max_new_tokens=90, temperature=1.0, seed=4)
    new = StaticEngine(model, length_bucket=32).generate_ids(prompts, 4, sp, ignore_eos=True)
    old = StaticEngine(model, length_bucket=32, shared_prefix=False, attention="sdpa").generate_ids(
        prompts, 4, sp, ignore_eos=True)
    same = (new.completion_ids == old.completion_ids).float().mean()
    assert same > 0.9, same  # bf16 rounding may flip a sample; from there the rows differ
    first = (new.completion_ids != old.completion_ids).float().argmax(1)  # agree up to here
    for r in range(len(new)):
        k = int(first[r]) if (new.completion_ids[r] != old.completion_ids[r]).any() else new.completion_ids.shape[1]
        torch.testing.assert_close(new.logprobs[r, :k], old.logprobs[r, :k], atol=3e-2, rtol=0)


# -- grouped LoRA (two launches per projection group) -----------------------------------------------

def _lora_case(ranks, outs, m, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE, dtype)  # noqa: E731
    As = [mk(r, k) for r in ranks]
    Bs = [mk(n, r) for n, r in zip(outs, ranks)]
    offsets = [sum(outs[:i]) + 2 for i in range(len(outs))]  # columns 0-1 and the last 3 have no adapter
    return mk(m, k), As, Bs, offsets, mk(m, sum(outs) + 5)


@pytest.mark.parametrize("ranks,outs", [([4, 4, 4], [48, 16, 16]), ([8, 16], [40, 72]), ([32], [64]),
                                        ([1], [17]), ([3, 5], [7, 33])], ids=str)
@pytest.mark.parametrize("m,k", [(1, 96), (5, 600), (19, 96), (2, 8448)])  # 600: 3 chunks; 8448: 17 of 512
def test_grouped_lora_matches_torch_path(ranks, outs, m, k):
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, As, Bs, offsets, y = _lora_case(ranks, outs, m, k, dtype, seed=m + len(ranks))
    scales = [0.5, 2.0, 1.5][:len(ranks)]
    assert kernels_take(y, x, As, Bs)
    want = lora_apply_ref_(y.clone(), x, As, Bs, offsets, scales)
    got = lora_apply_(y.clone(), x, As, Bs, offsets, scales)
    assert torch.equal(got[:, :2], y[:, :2]) and torch.equal(got[:, -3:], y[:, -3:])  # untouched columns
    assert not torch.equal(got, y)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: t rounded once either way, sums may differ in order
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("tiling", [Tiling(max_splits=1), Tiling(max_splits=4, block_m=64, n_blocks=4),
                                    Tiling(block_m=32, n_blocks=2), Tiling(max_splits=3, n_blocks=8),
                                    Tiling(reduce=True), Tiling(max_splits=4, block_m=32, n_blocks=4, reduce=True)],
                         ids=str)
@pytest.mark.parametrize("m,k", [(5, 600), (19, 2048)])
def test_grouped_lora_tilings_match_the_torch_path(tiling, m, k):
    # fewer K chunks, more rows or more column blocks per program: the same sums, cut differently
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, As, Bs, offsets, y = _lora_case([8, 16], [40, 330], m, k, dtype, seed=m + tiling.n_blocks)
    part = lora_shrink(x, As, tiling)
    # K in chunks of 256 x j, at most max_splits of them (the default would cut 2048 into 8); reduce: summed
    assert part.splits <= tiling.max_splits and (part.splits > 1) == (tiling.max_splits > 1 and not tiling.reduce)
    want = lora_apply_ref_(y.clone(), x, As, Bs, offsets, [0.5, 2.0])
    got = lora_apply_(y.clone(), x, As, Bs, offsets, [0.5, 2.0], tiling)
    assert torch.equal(got[:, :2], y[:, :2]) and torch.equal(got[:, -3:], y[:, -3:])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("m,want", [(1, Tiling(max_splits=8)), (16, Tiling(max_splits=8)),
                                    (17, Tiling(max_splits=8, block_m=64, reduce=True)),
                                    (64, Tiling(max_splits=8, block_m=64, reduce=True))])
def test_lora_apply_cuts_its_rows_as_tiling_for_says(m, want, monkeypatch):
    # the measured choice (bench/results/lora_tiling_h100/lora_tiling.md): 16-row programs up to 16 rows, then 64-row
    # programs whose shrink sums its 8 chunks; an explicit tiling still wins
    from qerl_kit.kernels import lora_triton

    seen, shrink = [], lora_triton.lora_shrink
    monkeypatch.setattr(lora_triton, "lora_shrink", lambda x, As, t: seen.append(t) or shrink(x, As, t))
    x, As, Bs, offsets, y = _lora_case([8, 16], [40, 72], m, 600, torch.float32, seed=m)
    assert lora_triton.tiling_for(m) == want
    got = lora_apply_(y.clone(), x, As, Bs, offsets, [0.5, 2.0])
    lora_apply_(y.clone(), x, As, Bs, offsets, [0.5, 2.0], Tiling())
    assert seen == [want, Tiling()]
    want_y = lora_apply_ref_(y.clone(), x, As, Bs, offsets, [0.5, 2.0])
    torch.testing.assert_close(got, want_y, atol=1e-4 * want_y.abs().max().item(), rtol=0)


# The real Qwen2.5-0.5B's decode groups (in, outs), LoRA r=32 on every projection: widths that are no
# power of two (896 = 7 x 128, 4864 = 38 x 128), so K chunks and column blocks end part-way.
REAL_GROUPS = {"qkv": (896, [896, 128, 128]), "o": (896, [896]), "gate_up": (896, [4864, 4864]), "down": (4864, [896])}


@pytest.mark.parametrize("group", sorted(REAL_GROUPS))
@pytest.mark.parametrize("m,tiling", [(8, Tiling()), (8, Tiling(reduce=True)),
                                      (64, Tiling(max_splits=4, block_m=64, n_blocks=4, reduce=True))], ids=str)
def test_grouped_lora_at_the_real_models_decode_shapes(group, m, tiling):
    k, outs = REAL_GROUPS[group]
    dtype = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator().manual_seed(m + len(outs))
    mk = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(DEVICE, dtype)  # noqa: E731
    x, y = mk(m, k), mk(m, sum(outs))
    As, Bs = [mk(32, k, s=0.02) for _ in outs], [mk(n, 32, s=0.02) for n in outs]
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    want = lora_apply_ref_(y.clone(), x, As, Bs, offsets, [2.0] * len(outs))
    got = lora_apply_(y.clone(), x, As, Bs, offsets, [2.0] * len(outs), tiling)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


@pytest.mark.skipif(not CUDA, reason="programs race only on a GPU (the interpreter runs them one at a time)")
@pytest.mark.parametrize("group", ["qkv", "gate_up", "down"])
def test_gpu_the_shrinks_sum_never_reads_a_chunk_before_it_is_stored(group):
    # reduce=True at the tiling lora_apply_ picks for a rollout's 128 rows (64-row programs, 8 chunks): the
    # last program to arrive sums the others' chunks, which all their warps must have stored first (the
    # CTA barrier Triton puts before the scalar arrival atomic). The partials' memory is NaN before each
    # call, so a chunk read early is a NaN; every call must give the first call's bits, near the torch path.
    from qerl_kit.kernels.lora_triton import tiling_for

    k, outs = REAL_GROUPS[group]
    g = torch.Generator().manual_seed(len(outs))
    mk = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to("cuda", torch.bfloat16)  # noqa: E731
    x, y = mk(128, k), mk(128, sum(outs))
    As, Bs = [mk(16, k, s=0.03) for _ in outs], [mk(n, 16, s=0.01) for n in outs]
    offsets, scales = [sum(outs[:i]) for i in range(len(outs))], [2.0] * len(outs)
    assert tiling_for(128).reduce
    want = lora_apply_ref_(y.clone(), x, As, Bs, offsets, scales)
    first = lora_apply_(y.clone(), x, As, Bs, offsets, scales)
    torch.testing.assert_close(first, want, atol=2e-2 * want.abs().max().item(), rtol=0)
    rt = 16 * len(outs)
    for _ in range(300):
        y_in = y.clone()
        # NaN blocks of every size the partials (1..8 chunks) and their sum take, freed: the call reuses them
        poison = [torch.full((splits, 128, rt), float("nan"), device="cuda") for splits in range(1, 9)]
        del poison
        got = lora_apply_(y_in, x, As, Bs, offsets, scales)
        assert torch.equal(got, first)


@pytest.mark.parametrize("m,k,block_m", [(5, 600, 16), (19, 2048, 16), (40, 1100, 32)])
def test_the_shrinks_own_sum_gives_the_expands_bits_and_leaves_its_counters_at_zero(m, k, block_m):
    # reduce=True: the last chunk to arrive sums the chunks in the order the expand would
    from qerl_kit.kernels.splitk import arrival_counters

    dtype = torch.bfloat16 if CUDA else torch.float32
    x, As, Bs, offsets, y = _lora_case([16, 8, 8], [64, 16, 16], m, k, dtype, seed=m)
    split = lora_apply_(y.clone(), x, As, Bs, offsets, [0.5, 2.0, 1.5], Tiling(block_m=block_m))
    summed = lora_shrink(x, As, Tiling(block_m=block_m, reduce=True))
    assert summed.splits == 1  # the expand reads one partial
    got = lora_apply_(y.clone(), x, As, Bs, offsets, [0.5, 2.0, 1.5], Tiling(block_m=block_m, reduce=True))
    assert torch.equal(got, split)
    assert int(arrival_counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("key,value", [("max_splits", 0), ("max_splits", 33), ("block_m", 8), ("n_blocks", 3),
                                       ("block_m", True), ("reduce", 1)])
def test_a_tiling_outside_the_kernels_range_is_refused_with_its_key(key, value):
    with pytest.raises(ValueError, match=f"Tiling.{key} must be .*got {value!r}"):
        Tiling(**{key: value})


def test_grouped_lora_falls_back_beyond_its_limits():
    x, As, Bs, offsets, y = _lora_case([4] * 4, [8] * 4, 3, 32, torch.float32, seed=1)
    assert not kernels_take(y, x, As, Bs)                                  # four adapters
    x, As, Bs, offsets, y = _lora_case([129], [8], 3, 32, torch.float32, seed=2)
    assert not kernels_take(y, x, As, Bs)                                  # rank over 128
    want = lora_apply_ref_(y.clone(), x, As, Bs, offsets, [1.0])
    assert torch.equal(lora_apply_(y.clone(), x, As, Bs, offsets, [1.0]), want)  # the torch path itself


def test_grouped_lora_with_float32_adapters_on_a_bf16_step():
    # peft's default keeps adapters in float32 on a bf16 base: x is cast up, t rounded back down
    g = torch.Generator().manual_seed(7)
    As = [torch.randn(8, 64, generator=g).to(DEVICE) for _ in range(2)]
    Bs = [torch.randn(24, 8, generator=g).to(DEVICE) for _ in range(2)]
    x = torch.randn(3, 64, generator=g).to(DEVICE, torch.bfloat16)
    y = torch.randn(3, 50, generator=g).to(DEVICE, torch.bfloat16)
    assert kernels_take(y, x, As, Bs)
    want = lora_apply_ref_(y.clone(), x, As, Bs, [0, 26], [0.5, 2.0])
    got = lora_apply_(y.clone(), x, As, Bs, [0, 26], [0.5, 2.0])
    assert got.dtype == torch.bfloat16 and torch.equal(got[:, 24:26], y[:, 24:26])
    # bf16 rounding of t and y (the CPU interpreter truncates its casts): a few bf16 ulps
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * want.float().abs().max().item(), rtol=0)
