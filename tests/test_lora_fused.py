"""LoRA expands fused into the kernels that read the projections' outputs (qerl_kit.kernels.lora_fused):
each consumer with a pending LoRA against the reference composition (lora_apply_ref_, then the
consumer's reference) and against the separate-expand path it replaces (lora_apply_, then the
consumer's kernel: equal but for float32 summation order), and the fused decode step with
``lora_fusion`` on and off. CPU: Triton's interpreter (as tests/test_engine_fused.py); GPU: compiled.
"""

import pytest
import torch

from tests import triton_interp

IN_PROCESS = triton_interp.enable()  # before Triton's first import

triton = pytest.importorskip("triton", reason="the fused kernels need triton")

from qerl_kit.engine import fast  # noqa: E402
from qerl_kit.kernels import lora_fused  # noqa: E402
from qerl_kit.kernels.engine_fused import add_rmsnorm_ref, rope_to_cache_ref, silu_mul_ref  # noqa: E402
from qerl_kit.kernels.lora_fused import add_rmsnorm, rope_to_cache, silu_mul  # noqa: E402  (these take lora=)
from qerl_kit.kernels.lora_triton import LoraDelta, lora_apply_, lora_apply_ref_, lora_shrink  # noqa: E402
from qerl_kit.lora import attach_lora  # noqa: E402
from qerl_kit.models import build_model  # noqa: E402
from qerl_kit.rollout import SamplingParams, StaticEngine  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BF16_TOL = 2 ** -7 if CUDA else 3 * 2 ** -7  # the interpreter truncates float32 -> bf16 casts (torch rounds)


@pytest.fixture(autouse=True)
def _runnable(request):
    if not IN_PROCESS and request.node.name != "test_in_an_interpreter_subprocess":
        pytest.skip("Triton was imported before TRITON_INTERPRET=1: the subprocess test runs these")


@pytest.mark.skipif(IN_PROCESS, reason="the tests run in this process")
def test_in_an_interpreter_subprocess():
    triton_interp.rerun_in_subprocess(__file__)


class Case:
    """A projection group's input x [R, K] and adapters (A_i [r_i, K], B_i [n_i, r_i] at ``offsets``)."""

    def __init__(self, R, K, ranks, outs, offsets, dtype, seed, scales=(0.5, 2.0, 1.5), adapter_dtype=None):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.x = self.rand(R, K)
        adt = adapter_dtype or dtype
        self.As = [(self.rand(r, K) / K ** 0.5).to(adt) for r in ranks]
        self.Bs = [self.rand(n, r).to(adt) for n, r in zip(outs, ranks)]
        self.offsets, self.scales = list(offsets), list(scales[:len(ranks)])

    def rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.dtype).to(DEVICE)

    def delta(self) -> LoraDelta:
        return LoraDelta(lora_shrink(self.x, self.As), self.Bs, self.offsets, self.scales)

    def ref(self, y):  # the reference expand (torch ops, from x and A)
        return lora_apply_ref_(y.clone(), self.x, self.As, self.Bs, self.offsets, self.scales)

    def separate(self, y):  # the path the fused consumers replace: shrink + expand launches
        return lora_apply_(y.clone(), self.x, self.As, self.Bs, self.offsets, self.scales)


def _close(got, want, dtype, scale=1.0):
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol)


def _same_as_separate(got, sep, dtype, min_equal):
    """Equal to the separate-expand path: bit for bit on most elements, within an ulp on the rest."""
    equal = (got == sep).float().mean().item()
    assert equal >= min_equal, equal
    _close(got, sep, dtype, scale=sep.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("N,ranks,outs,offsets", [(96, [8], [96], [0]), (96, [16], [96], [0]),
                                                  (96, [8, 16, 4], [40, 30, 10], [3, 50, 86]),
                                                  (1500, [32], [1500], [0])], ids=str)  # 1500: ranks 8 at a time
@pytest.mark.parametrize("residual", [True, False])
def test_add_rmsnorm_with_lora(dtype, N, ranks, outs, offsets, residual):
    c = Case(5, 600, ranks, outs, offsets, dtype, seed=len(ranks) + 3 * residual)  # K 600: 3 shrink chunks
    x, w = c.rand(5, N), c.rand(N)
    r = c.rand(5, N) if residual else None
    out, h = add_rmsnorm(x, r, w, 1e-6, lora=c.delta())
    want_out, want_h = add_rmsnorm_ref(c.ref(x), r, w, 1e-6)
    sep_out, sep_h = add_rmsnorm(c.separate(x), r, w, 1e-6, use_triton=True)
    plain_out, _ = add_rmsnorm(x, r, w, 1e-6, use_triton=True)
    assert (out != plain_out).float().mean() > 0.5  # the LoRA changed the result
    _close(h, want_h, dtype, scale=want_h.abs().max().item())
    _close(out, want_out, dtype, scale=want_out.abs().max().item())
    # one row's rank-r sum in another order than the expand's dot: float32 roundings (bf16: rarely a last bit)
    _same_as_separate(h, sep_h, dtype, min_equal=0.97 if dtype == torch.bfloat16 else 0.0)
    _same_as_separate(out, sep_out, dtype, min_equal=0.97 if dtype == torch.bfloat16 else 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("which,rank", [("qkv", 8), ("qv", 16), ("k", 16)])
@pytest.mark.parametrize("R", [3, 18])  # 18: two blocks of rows
def test_rope_to_cache_with_lora(dtype, which, rank, R):
    H, KVH, D, L, P = 4, 2, 16, 9, 3  # P: a shared prefix's length (the rows' own slots start there)
    widths = {"q": H * D, "k": KVH * D, "v": KVH * D}
    starts = {"q": 0, "k": H * D, "v": (H + KVH) * D}
    c = Case(R, 96, [rank] * len(which), [widths[p] for p in which], [starts[p] for p in which], dtype, seed=R)
    qkv = c.rand(R, (H + 2 * KVH) * D)
    cos, sin = c.rand(R, D), c.rand(R, D)
    slot = torch.tensor([P + 5], device=DEVICE)
    kc, vc = c.rand(R, KVH, L, D), c.rand(R, KVH, L, D)

    def run(y, fn, **kw):
        k_cache, v_cache = kc.clone(), vc.clone()
        q = y[:, :H * D].view(R, H, D)
        k = y[:, H * D:(H + KVH) * D].view(R, KVH, D)
        v = y[:, (H + KVH) * D:].view(R, KVH, D)
        return fn(q, k, v, cos, sin, k_cache, v_cache, slot, offset=P, **kw), k_cache, v_cache

    got = run(qkv, rope_to_cache, lora=c.delta())
    want = run(c.ref(qkv), rope_to_cache_ref)
    sep = run(c.separate(qkv), rope_to_cache, use_triton=True)
    plain = run(qkv, rope_to_cache, use_triton=True)
    others = [j for j in range(L) if j != 5]  # cache columns other than slot - P
    for name, g, w, s, p, before in zip("qkv", got, want, sep, plain, (None, kc, vc)):
        if before is not None:
            assert torch.equal(g[:, :, others], before[:, :, others])
        _close(g, w, dtype, scale=3 * w.abs().max().item())  # bf16: a few roundings in each path
        assert torch.equal(g, s)  # the separate path's values bit for bit
        assert torch.equal(g, p) == (name not in which)  # only the adapters' projections change


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ranks,outs,offsets", [([8, 8], [150, 150], [0, 150]), ([16], [130], [170]),
                                                ([8, 16, 4], [100, 40, 60], [0, 120, 200])], ids=str)
@pytest.mark.parametrize("R", [3, 19])
def test_silu_mul_with_lora(dtype, ranks, outs, offsets, R):
    c = Case(R, 600, ranks, outs, offsets, dtype, seed=R + len(ranks))
    gu = c.rand(R, 300)  # N = 150: not a multiple of the 64-column blocks
    got = silu_mul(gu, lora=c.delta())
    want = silu_mul_ref(c.ref(gu))
    _close(got, want, dtype, scale=want.abs().max().item())  # bf16: an ulp of gate or up, times the other
    assert torch.equal(got, silu_mul(c.separate(gu), use_triton=True))
    assert (got != silu_mul(gu, use_triton=True)).float().mean() > 0.3


@pytest.mark.parametrize("dtype,adapter_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=str)
def test_adapters_in_another_dtype(dtype, adapter_dtype):
    # peft keeps float32 adapters on a bf16 base: x cast up, t rounded down to y's dtype; bf16 adapters
    # on a float32 step: t rounded to bf16 first
    c = Case(4, 200, [8, 8], [96, 64], [0, 96], dtype, seed=5, adapter_dtype=adapter_dtype)
    gu = c.rand(4, 160)
    got = silu_mul(gu, lora=LoraDelta(lora_shrink(c.x, c.As), c.Bs, [0, 80], c.scales))
    c.offsets = [0, 80]
    assert torch.equal(got, silu_mul(c.separate(gu), use_triton=True))
    want = silu_mul_ref(c.ref(gu))
    _close(got, want, torch.bfloat16, scale=want.abs().max().item())  # t has bf16's precision either way
    c.offsets, c.Bs = [0], c.Bs[:1]
    c.As = c.As[:1]
    x, w, r = c.rand(4, 96), c.rand(96), c.rand(4, 96)
    out, h = add_rmsnorm(x, r, w, 1e-6, lora=c.delta())
    _same_as_separate(h, add_rmsnorm(c.separate(x), r, w, 1e-6, use_triton=True)[1], dtype,
                      min_equal=0.97 if dtype == torch.bfloat16 else 0.0)
    want_h = add_rmsnorm_ref(c.ref(x), r, w, 1e-6)[1]
    _close(h, want_h, torch.bfloat16, scale=want_h.abs().max().item())


def test_what_the_fused_kernels_do_not_take_runs_the_separate_expand():
    dtype = torch.float32
    c = Case(3, 64, [4, 4], [40, 40], [0, 30], dtype, seed=1)  # overlapping columns [30, 40)
    gu, delta = c.rand(3, 160), c.delta()
    assert not lora_fused.fused_takes(gu, delta, 3)
    before = gu.clone()
    want = silu_mul_ref(c.ref(gu))
    _close(silu_mul(gu, lora=delta), want, dtype, scale=want.abs().max().item())
    assert torch.equal(gu, before)  # the fallback expands into a copy
    c = Case(3, 64, [4], [96], [0], dtype, seed=2)
    x, w, r = c.rand(3, 96), c.rand(96), c.rand(3, 96)
    for got in (add_rmsnorm(x, r, w, 1e-6, use_triton=False, lora=c.delta()),):
        want = add_rmsnorm_ref(c.ref(x), r, w, 1e-6)
        _close(got[0], want[0], dtype, scale=want[0].abs().max().item())
        _close(got[1], want[1], dtype, scale=want[1].abs().max().item())


# -- the fused decode step --------------------------------------------------------------------------

def _policy(preset, dtype):
    model = build_model(preset, seed=1, dtype=dtype, device=DEVICE)
    model = attach_lora(model, r=4, seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # non-zero B: the LoRA changes every projection
    return model


@pytest.mark.parametrize("preset", ["qwen2-tiny", "qwen3-tiny"])  # qwen3: q/k norms, q/k/v expanded separately
def test_decode_with_and_without_lora_fusion_and_a_live_update(preset, monkeypatch):
    dtype = torch.bfloat16 if CUDA else torch.float32
    model = _policy(preset, dtype)
    calls = []
    separate = fast.lora_apply_
    monkeypatch.setattr(fast, "lora_apply_", lambda *a: calls.append(1) or separate(*a))
    engines = {f: StaticEngine(model, lora_fusion=f, length_bucket=8) for f in (True, False)}
    generic = StaticEngine(model, fused=False)
    assert all(e.decoder.path == "fused" and e.decoder.plan.lora_fusion == f for f, e in engines.items())
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    outs = []
    for update in (False, True):
        if update:  # an optimizer's in-place step: seen by the next call (and by graphs captured before it)
            with torch.no_grad():
                for p in lora_b:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)).to(p) * 0.05)
        calls.clear()
        a = engines[True].generate_ids(prompts, 1, sp, ignore_eos=True)
        fused_calls = len(calls)
        calls.clear()
        b = engines[False].generate_ids(prompts, 1, sp, ignore_eos=True)
        layers = model.config.num_hidden_layers
        assert len(calls) == 4 * layers * 2  # every group, 2 decode steps (the first token is the prefill's)
        assert fused_calls == (2 * layers if preset == "qwen3-tiny" else 0)  # only q/k/v, before q_norm
        g = generic.generate_ids(prompts, 1, sp, ignore_eos=True)
        for other, tol in ((b, 1e-5 if not CUDA else 2e-2), (g, 2e-3 if not CUDA else 6e-2)):
            if torch.equal(a.completion_ids, other.completion_ids):
                torch.testing.assert_close(a.logprobs, other.logprobs, atol=tol, rtol=0)
            else:  # bf16 rounding may flip a sample; then the first differing token is a near tie
                assert CUDA
        outs.append(a)
        assert engines[True].decoder.path == "fused"  # no kernel failed (that would switch to the generic path)
    assert not torch.equal(outs[0].logprobs, outs[1].logprobs)
