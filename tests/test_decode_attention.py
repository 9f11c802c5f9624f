"""Decode attention (qerl_kit.kernels.decode_attention): the split-KV Triton kernel against the
plain-PyTorch reference on fresh random inputs, with and without a shared prompt prefix, one and
several splits, masked (left-padded) keys; and the reference against a dense attention written out.

The kernel runs on the CPU under TRITON_INTERPRET=1 (set before Triton's first import; in a full
run this module re-runs itself in a subprocess with it set), or on the GPU.
"""

import math

import pytest
import torch

from tests import triton_interp

IN_PROCESS = triton_interp.enable()  # before Triton's first import

from qerl_kit.kernels.decode_attention import (Prefix, decode_attention,  # noqa: E402
                                               decode_attention_ref, num_splits)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(autouse=True)
def _runnable(request):
    if not IN_PROCESS and request.node.name != "test_in_an_interpreter_subprocess" \
            and "kernel" in request.node.name:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1: the subprocess test runs these")


@pytest.mark.skipif(IN_PROCESS, reason="the tests run in this process")
def test_in_an_interpreter_subprocess():
    triton_interp.rerun_in_subprocess(__file__)


def _case(R=6, KVH=2, G=3, D=32, B=2, P=40, S=50, length=70, dtype=torch.float32, seed=0, pad=(5, 0)):
    """Random q/k/v, a prefix of B prompts for R rows (R // B each), left padding ``pad[b]`` keys of
    prompt b masked, and slots beyond each row's ``length`` unwritten (random garbage, masked)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    q, k, v = rnd(R, KVH, G, D), rnd(R, KVH, S, D), rnd(R, KVH, S, D)
    pk, pv = rnd(B, KVH, P, D), rnd(B, KVH, P, D)
    prow = torch.arange(B).repeat_interleave(R // B).to(DEVICE)
    bias = torch.zeros(R, P + S, dtype=dtype, device=DEVICE)
    for r in range(R):
        bias[r, :pad[int(prow[r])]] = float("-inf")
    bias[:, length:] = float("-inf")  # never read anyway: length bounds every path
    bias[1, P + 3] = float("-inf")  # one row's own slot masked (e.g. never written)
    return q, k, v, bias, Prefix(pk, pv, prow)


def _dense(q, keys, values, bias, scale):
    """softmax(q k^T * scale + bias) v written out per row and head, in float64."""
    R, KVH, G, D = q.shape
    out = torch.empty(R, KVH, G, D, dtype=torch.float64)
    for r in range(R):
        for h in range(KVH):
            s = q[r, h].double() @ keys[r, h].double().T * scale + bias[r].double()
            out[r, h] = torch.softmax(s, -1) @ values[r, h].double()
    return out


def test_reference_equals_dense_attention_over_the_gathered_keys():
    q, k, v, bias, pre = _case()
    P, L, scale = pre.k.shape[2], 70, 32 ** -0.5
    got = decode_attention_ref(q, k, v, bias, L, scale, pre)
    keys = torch.cat([pre.k[pre.prompt_row], k[:, :, :L - P]], 2).cpu()
    values = torch.cat([pre.v[pre.prompt_row], v[:, :, :L - P]], 2).cpu()
    want = _dense(q.cpu(), keys, values, bias[:, :L].cpu(), scale)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5)


def test_reference_with_a_prefix_equals_the_plain_layout_holding_copies():
    q, k, v, bias, pre = _case(seed=3)
    P, L, scale = pre.k.shape[2], 81, 0.2
    plain_k = torch.cat([pre.k[pre.prompt_row], k], 2)
    plain_v = torch.cat([pre.v[pre.prompt_row], v], 2)
    torch.testing.assert_close(decode_attention_ref(q, k, v, bias, L, scale, pre),
                               decode_attention_ref(q, plain_k, plain_v, bias, L, scale), atol=0, rtol=0)
    assert not torch.allclose(decode_attention_ref(q, k, v, bias, L, scale, pre),
                              decode_attention_ref(q, k, v, bias, L - P, scale))


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("with_prefix", [True, False])
def test_kernel_matches_reference(splits, with_prefix):
    q, k, v, bias, pre = _case(seed=11 + (splits or 0) + 5 * with_prefix)
    if not with_prefix:
        pre, k, v = None, torch.cat([pre.k[pre.prompt_row], k], 2), torch.cat([pre.v[pre.prompt_row], v], 2)
    L, scale = 70, 1 / math.sqrt(32)
    got = decode_attention(q, k, v, bias, L, scale, pre, impl="triton", splits=splits)
    want = decode_attention_ref(q, k, v, bias, L, scale, pre)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("length", [17, 40, 41, 90])
def test_kernel_reads_exactly_the_first_length_keys(length):
    """A length inside the prefix, at its end, one past it, and at the full cache (P = 40, S = 50)."""
    q, k, v, bias, pre = _case(seed=length, pad=(0, 7))
    got = decode_attention(q, k, v, bias, length, 0.3, pre, impl="triton", splits=2)
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, bias, length, 0.3, pre), atol=2e-5, rtol=2e-5)
    k2 = k.clone()
    k2[:, :, max(0, length - 40):] = torch.randn_like(k2[:, :, max(0, length - 40):]) * 100  # beyond length
    torch.testing.assert_close(decode_attention(q, k2, v, bias, length, 0.3, pre, impl="triton", splits=2), got,
                               atol=0, rtol=0)


def test_kernel_bf16_and_eight_query_heads_per_kv_head():
    q, k, v, bias, pre = _case(R=4, KVH=1, G=7, D=64, P=64, S=32, length=90, dtype=torch.bfloat16, seed=5)
    got = decode_attention(q, k, v, bias, 90, 0.125, pre, impl="triton")
    want = decode_attention_ref(q.float(), k.float(), v.float(), bias.float(), 90, 0.125,
                                Prefix(pre.k.float(), pre.v.float(), pre.prompt_row))
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_bad_arguments_are_refused_with_the_shapes():
    q, k, v, bias, pre = _case()
    with pytest.raises(ValueError, match="length 91 must be in"):
        decode_attention(q, k, v, bias, 91, 0.1, pre, impl="torch")
    with pytest.raises(ValueError, match="impl='nope'"):
        decode_attention(q, k, v, bias, 10, 0.1, pre, impl="nope")
    with pytest.raises(ValueError, match="plain layout only"):
        decode_attention(q, k, v, bias, 10, 0.1, pre, impl="sdpa")
    with pytest.raises(ValueError, match="prompt_row"):
        decode_attention(q, k, v, bias, 10, 0.1, Prefix(pre.k, pre.v, pre.prompt_row[:2]), impl="torch")


def test_split_count_fills_the_gpu_and_keeps_whole_blocks():
    dev = torch.device("cpu")  # 8 "SMs" on the CPU
    assert num_splits(4, 1000, dev) == 4  # 16 programs wanted, 4 rows x heads
    assert num_splits(64, 1000, dev) == 1
    assert num_splits(1, 100, dev) == 2  # 100 keys are two blocks of 64
