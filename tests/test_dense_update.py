"""Dense base weights for the training pass (qerl_kit.dense_update, qerl_kit.dense_cache's budgeted blocks).

Inside ``update_cache`` every 4-bit projection is dequantized once per block, and forward, backward
and a whole Trainer step give the same bits as without the block, for NVFP4, NF4 and MXFP4 bases
with LoRA; the budget caches the first weights that fit and no more; the block frees everything on
exit; a weight changed in place inside the block is dequantized again. The GPU routes' exactness is
in the CUDA tests at the end (skipped without CUDA); the Triton dense route in the interpreter is in
tests/test_dense_cache_kernels.py.
"""

import gc
import weakref

import pytest
import torch

from qerl_kit import dense_cache, dense_update, mxfp4, nf4, nvfp4
from qerl_kit.config import ConfigError, from_dict
from qerl_kit.linear import QuantLinear
from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FORMATS = {"nvfp4": nvfp4, "nf4": nf4, "mxfp4": mxfp4}
CUDA = torch.cuda.is_available()


def _policy(fmt, seed=0, device="cpu", dtype=torch.float32):
    model = build_model("qwen2-tiny", seed=seed, dtype=dtype, device=device)
    quantize_model(model, fmt=fmt)
    return attach_lora(model, r=4, seed=seed)


def _batch(seed=1, rows=3, length=11, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (rows, length), generator=g).to(device)


def _count_dequantize(monkeypatch, fmt):
    """How often the format's plain-PyTorch dequantize runs (every uncached dense weight on the CPU)."""
    module, calls = FORMATS[fmt], []
    real = module.dequantize
    monkeypatch.setattr(module, "dequantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _train_pass(model, ids, passes=2):
    """``passes`` forward + backward passes (as mu updates do); the logits and LoRA gradients of each."""
    out = []
    for _ in range(passes):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        (logits.float().square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        out.append((logits.detach().clone(), grads))
    return out


def _layers(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


def _same(a, b):
    for (la, ga), (lb, gb) in zip(a, b):
        assert torch.equal(la, lb)
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_forward_backward_in_the_block_is_bit_identical_and_dequantizes_each_weight_once(fmt, monkeypatch):
    model, ids = _policy(fmt), _batch()
    calls = _count_dequantize(monkeypatch, fmt)
    plain = _train_pass(model, ids)
    outside = len(calls)
    n = len(_layers(model))
    assert outside > 2 * n  # a forward per layer per pass, and the backward dequantizes again
    calls.clear()
    with dense_update.update_cache(model) as block:  # auto on the CPU: all of the tiny model
        cached = _train_pass(model, ids)
        assert block.bytes_held == dense_update.dense_projection_bytes(model, torch.float32) > 0
        assert dense_cache.block_stats()["entries"] == n
    assert len(calls) == n and block.misses == n and block.refused == 0 and block.hits > n
    _same(plain, cached)
    assert any(g.abs().sum() > 0 for g in cached[0][1].values())  # real gradients, not zeros


def test_the_block_frees_every_dense_weight_on_exit():
    model, ids = _policy("nvfp4"), _batch()
    with dense_update.update_cache(model) as block:
        _train_pass(model, ids, passes=1)
        entry = next(iter(dense_cache._block.entries.values()))
        held = weakref.ref(entry[0])
        del entry
    gc.collect()
    assert held() is None and dense_cache._block is None and dense_cache.block_stats() == {}
    assert block.bytes_held == 0 and block.peak_bytes > 0 and not block.entries


def test_a_budget_that_fits_some_weights_caches_only_those_and_the_rest_still_work(monkeypatch):
    model, ids = _policy("nf4"), _batch()
    plain = _train_pass(model, ids)
    sizes = [m.in_features * m.out_features * 4 for m in _layers(model)]  # float32 dense weights
    budget = sum(sizes[:3]) + sizes[3] // 2  # room for the first three, not the fourth
    calls = _count_dequantize(monkeypatch, "nf4")
    with dense_update.update_cache(model, gib=budget / dense_update.GIB) as block:
        cached = _train_pass(model, ids)
        stats = dense_cache.block_stats()
    _same(plain, cached)
    assert stats["bytes_held"] <= stats["budget_bytes"] == int(budget / dense_update.GIB * dense_update.GIB)
    assert stats["entries"] >= 3 and block.refused >= 1  # smaller later weights may still fit
    assert stats["entries"] + block.refused == len(sizes)
    refused_calls = len(calls) - stats["entries"]  # refused weights: dequantized per forward and backward
    assert refused_calls >= 2 * 2 * block.refused


def test_budget_zero_is_off_and_caches_nothing(monkeypatch):
    model, ids = _policy("mxfp4"), _batch()
    calls = _count_dequantize(monkeypatch, "mxfp4")
    with dense_update.update_cache(model, gib=0) as block:
        _train_pass(model, ids, passes=1)
        assert dense_cache._block is None
    assert block.peak_bytes == 0 and len(calls) > len(_layers(model))  # forwards and backwards dequantize


def test_a_weight_changed_in_place_inside_the_block_is_not_served_stale():
    model, ids = _policy("nvfp4"), _batch()
    layer = _layers(model)[0]
    g = torch.Generator().manual_seed(5)
    other = nvfp4.quantize(torch.randn(layer.out_features, layer.in_features, generator=g))
    with dense_update.update_cache(model) as block:
        _train_pass(model, ids, passes=1)
        held = block.bytes_held
        layer.packed.copy_(other.packed)  # an in-place change: a version bump of a key tensor
        layer.scales.copy_(other.scales)
        inside = _train_pass(model, ids, passes=1)
        assert block.bytes_held == held  # the stale copy was dropped, the new one took its place
    fresh = _train_pass(model, ids, passes=1)
    _same(fresh, inside)


def test_cache_stats_count_hits_misses_and_refusals_per_block_and_in_total():
    w = torch.randn(8, 4)
    before = dense_cache.cache_stats()
    with dense_cache.dense_weight_cache(budget_bytes=8 * 4 * 4) as block:
        a = dense_cache.cached((w,), torch.float32, lambda: w * 2, shape=(8, 4))
        b = dense_cache.cached((w,), torch.float32, lambda: w * 2, shape=(8, 4))
        c = dense_cache.cached((w,), torch.float64, lambda: w.double() * 2, shape=(8, 4))  # over budget
        d = dense_cache.cached((w,), torch.float64, lambda: w.double() * 2, shape=(8, 4))
    after = dense_cache.cache_stats()
    assert a is b and c is not d and torch.equal(c, d)
    assert (block.hits, block.misses, block.refused) == (1, 1, 1)  # a weight is refused once, counted once
    assert {k: after[k] - before[k] for k in after} == {"hits": 1, "misses": 1, "refused": 1}
    with pytest.raises(ValueError, match="budget_bytes"):
        with dense_cache.dense_weight_cache(budget_bytes=-1):
            pass


def test_cuda_tensors_are_cached_only_in_a_block_that_allows_them(monkeypatch):
    """The device check the training block lifts (cuda=True), with a CPU tensor standing in for a CUDA one."""
    w = torch.randn(4, 4)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for allow, expect in ((False, 2), (True, 1)):
        calls = []
        with dense_cache.dense_weight_cache(cuda=allow):
            for _ in range(2):
                dense_cache.cached((w,), torch.float32, lambda: calls.append(1) or w * 2, shape=(4, 4))
        assert len(calls) == expect


def test_dense_projection_bytes_of_a_model_and_of_its_shape_agree():
    model = build_model("qwen2-tiny", seed=0)
    quantize_model(model, fmt="nvfp4")
    by_layers = dense_update.dense_projection_bytes(model)
    assert by_layers == sum(4 * m.in_features * m.out_features for m in _layers(model)) > 0  # float32 layers
    assert dense_update.dense_projection_bytes(model.config, torch.float32) == by_layers
    assert dense_update.dense_projection_bytes(model, torch.bfloat16) == by_layers // 2
    assert dense_update.dense_projection_bytes("Qwen2.5-7B") == 2 * 28 * (2 * 3584 * 3584 + 2 * 3584 * 512
                                                                          + 3 * 3584 * 18944)


def test_the_auto_budget_on_the_cpu_takes_all_or_nothing(monkeypatch):
    model = _policy("nvfp4")
    need = dense_update.dense_projection_bytes(model)
    monkeypatch.setattr(dense_update, "available_ram", lambda: 4 * need)
    assert dense_update.cache_budget(model) == need
    monkeypatch.setattr(dense_update, "available_ram", lambda: 4 * need - 1)
    assert dense_update.cache_budget(model) == 0
    assert dense_update.cache_budget(model, 0.5) == 1 << 29
    with pytest.raises(ConfigError, match="model.dense_cache_gib"):
        dense_update.cache_budget(model, -1.0)


def test_the_auto_budget_on_cuda_measures_first_then_takes_free_memory_minus_the_working_set(monkeypatch):
    """The CUDA rule's arithmetic, with the device queries injected (no GPU needed)."""
    model, gib = _policy("nvfp4"), dense_update.GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 12 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    cuda = torch.device("cuda")
    assert dense_update.cache_budget(model, device=cuda) == 0  # no block measured yet
    dense_update._working_set[model] = 8 * gib
    # free 60 + 2 unused in the allocator, minus 1.25 x 8 working set, minus 5% of 100 slack
    assert dense_update.cache_budget(model, device=cuda) == 62 * gib - 10 * gib - 5 * gib
    assert dense_update.cache_budget(model, 3.0, device=cuda) == 3 * gib


def test_on_cuda_the_first_block_measures_and_the_next_caches_then_empties_the_allocator(monkeypatch):
    """update_cache's CUDA path (measure, budget, empty_cache) with the device and its queries injected."""
    model, ids, gib = _policy("nvfp4"), _batch(), dense_update.GIB
    emptied = []
    monkeypatch.setattr(dense_update, "_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 9 * gib)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    plain = _train_pass(model, ids, passes=1)
    with dense_update.update_cache(model) as first:
        one = _train_pass(model, ids, passes=1)
    assert first.peak_bytes == 0 and first.refused == len(_layers(model)) and not emptied
    assert dense_update._working_set[model] == 7 * gib  # peak 9 - 2 on entry - 0 cached
    with dense_update.update_cache(model) as second:
        two = _train_pass(model, ids, passes=1)
    assert second.budget_bytes == 40 * gib - int(1.25 * 7 * gib) - 5 * gib
    assert second.peak_bytes == dense_update.dense_projection_bytes(model) and emptied == [1]
    _same(plain, one)
    _same(plain, two)


def test_the_config_key_is_validated_with_a_clear_error():
    assert from_dict({"model": {"dense_cache_gib": 2}}).model.dense_cache_gib == 2.0
    assert from_dict({}).model.dense_cache_gib is None
    for bad in (-1, "lots", float("nan")):
        with pytest.raises(ConfigError, match="model.dense_cache_gib"):
            from_dict({"model": {"dense_cache_gib": bad}})


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_two_trainer_steps_with_and_without_the_cache_give_the_same_adapter(fmt, tmp_path, monkeypatch):
    from tests.test_rollout import make_tokenizer
    from tests.test_trainer import TASK, _config

    from qerl_kit.trainer import Trainer

    runs = {}
    for gib in (0, None):
        model = _policy(fmt)
        with torch.no_grad():
            model.base_model.model.lm_head.weight.mul_(4.0)
        cfg = _config(tmp_path / str(gib), model={"format": fmt, "lora_r": 4, "dense_cache_gib": gib})
        trainer = Trainer(model, make_tokenizer(), TASK, cfg, progress="none")
        rows = trainer.train(2).history
        adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        runs[gib] = rows, adapter
    (rows0, a0), (rows1, a1) = runs[0], runs[None]
    assert all(torch.equal(a0[k], a1[k]) for k in a0)
    assert any(not torch.equal(a1[k], p) for k, p in
               {n: p for n, p in _policy(fmt).named_parameters() if p.requires_grad}.items())  # it trained
    for r0, r1 in zip(rows0, rows1):
        assert r0["loss"] == r1["loss"] and r0["grad_norm"] == r1["grad_norm"]
        assert r0["memory/dense_cache_gib"] == 0 < r1["memory/dense_cache_gib"]


# ----------------------------------------------------------------------------- CUDA (skipped without a GPU)

@pytest.mark.skipif(not CUDA, reason="needs CUDA: the NVFP4 GPU routes and the CUDA budget")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_training_pass_is_bit_identical_in_the_block(fmt):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _policy(fmt, device="cuda", dtype=torch.bfloat16)
    ids = _batch(rows=4, length=96, device="cuda")  # 384 rows: the NVFP4 dense route (from 128)
    with sdpa_kernel(SDPBackend.MATH):  # a deterministic attention backward: only the cache may differ
        plain = _train_pass(model, ids)
        with dense_update.update_cache(model, gib=4.0) as block:
            cached = _train_pass(model, ids)
    _same(plain, cached)
    assert block.misses == len(_layers(model)) and block.hits > 0 and dense_cache._block is None


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the NVFP4 dense route")
def test_cuda_dense_route_forward_and_dgrad_are_bit_identical_and_share_one_weight():
    from qerl_kit import kernels
    from qerl_kit.kernels import nvfp4_gemm_triton as g

    g_ = torch.Generator().manual_seed(3)
    q = nvfp4.quantize(torch.randn(4096, 2048, generator=g_)).to("cuda")
    x = torch.randn(512, 2048, generator=g_).to("cuda", torch.bfloat16)
    dy = torch.randn(512, 4096, generator=g_).to("cuda", torch.bfloat16)
    assert kernels.route("forward", x, q.packed, q.scales) == "dense"
    y0, dx0 = kernels.nvfp4_linear(x, q.packed, q.scales, q.global_scale), \
        kernels.nvfp4_dgrad(dy, q.packed, q.scales, q.global_scale)
    with dense_cache.dense_weight_cache(budget_bytes=1 << 30, cuda=True) as block:
        for _ in range(2):
            y1, dx1 = kernels.nvfp4_linear(x, q.packed, q.scales, q.global_scale), \
                kernels.nvfp4_dgrad(dy, q.packed, q.scales, q.global_scale)
            assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert block.misses == 1 and block.hits == 3
    assert g.cached_dense_weight(q.packed, q.scales, q.global_scale, torch.bfloat16) is None  # no block open


@pytest.mark.skipif(not CUDA, reason="needs CUDA: the measured working set")
def test_cuda_auto_budget_caches_nothing_in_the_first_block_and_all_in_the_second():
    model = _policy("nvfp4", device="cuda", dtype=torch.bfloat16)
    ids = _batch(rows=4, length=96, device="cuda")
    dense_update._working_set.pop(model, None)
    with dense_update.update_cache(model) as first:
        _train_pass(model, ids, passes=1)
    with dense_update.update_cache(model) as second:
        _train_pass(model, ids, passes=1)
    assert first.peak_bytes == 0 and model in dense_update._working_set
    assert second.peak_bytes == dense_update.dense_projection_bytes(model)  # the tiny model fits an H200
