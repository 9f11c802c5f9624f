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
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from tests.tiny_policy import tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FORMATS = {"nvfp4": nvfp4, "nf4": nf4, "mxfp4": mxfp4}
CUDA = torch.cuda.is_available()


def _policy(fmt, seed=0, device="cpu", dtype=torch.float32):
    return tiny_policy(fmt, seed=seed, device=device, dtype=dtype)  # random lora_B: real LoRA gradients


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
    # one lookup per forward (the first pass's make the copies); the backward's dy @ W is autograd's
    # matmul on the W the forward read (qerl_kit.kernels.held_weight), no second lookup
    assert len(calls) == n and block.misses == n and block.refused == 0 and block.hits == n
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


def _fake_cuda(monkeypatch, free, allocated, peak, total=100 * dense_update.GIB):
    """update_cache's CUDA path on the CPU: the device and its memory queries injected (``free`` and
    ``peak`` are lists, so a test can change them between blocks); returns the empty_cache calls."""
    emptied = []
    monkeypatch.setattr(dense_update, "_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    return emptied


def test_on_cuda_the_first_block_measures_and_the_next_caches_then_empties_for_an_own_allocator(monkeypatch):
    """update_cache's CUDA path (measure, budget, empty_cache) with the device and its queries injected."""
    model, ids, gib = _policy("nvfp4"), _batch(), dense_update.GIB
    emptied = _fake_cuda(monkeypatch, [40 * gib], 2 * gib, [9 * gib])
    plain = _train_pass(model, ids, passes=1)
    with dense_update.update_cache(model, own_allocator=True) as first:
        one = _train_pass(model, ids, passes=1)
    assert first.peak_bytes == 0 and first.refused == len(_layers(model)) and not emptied
    assert dense_update._working_set[model] == 7 * gib  # peak 9 - 2 on entry - 0 cached, per 1 token
    with dense_update.update_cache(model, own_allocator=True) as second:
        two = _train_pass(model, ids, passes=1)
    assert second.budget_bytes == 40 * gib - int(1.25 * 7 * gib) - 5 * gib
    assert second.peak_bytes == dense_update.dense_projection_bytes(model) and emptied == [1]
    with dense_update.update_cache(model) as third:  # an engine on PyTorch's allocator: nothing emptied
        _train_pass(model, ids, passes=1)
    assert third.peak_bytes > 0 and emptied == [1]
    _same(plain, one)
    _same(plain, two)


def test_on_cuda_a_later_step_with_longer_completions_keeps_its_headroom(monkeypatch):
    """The first step trains on 1,500-token completions, a later one reaches the 4,096 cap: the budget
    reserves the working set per token at the cap, so the cache leaves the longer step its room."""
    model, gib = _policy("nvfp4"), dense_update.GIB
    micro, P, new = 4, 100, 4096
    first_tokens, cap_tokens = micro * (P + 1500), micro * (P + new)
    free, peak = [60 * gib], [2 * gib + 10 * gib]  # 2 GiB allocated on entry, a 10 GiB working set
    _fake_cuda(monkeypatch, free, 2 * gib, peak)
    with dense_update.update_cache(model, tokens=first_tokens, max_tokens=cap_tokens) as first:
        pass
    rate = dense_update._working_set[model]
    assert first.peak_bytes == 0 and rate == 10 * gib / first_tokens
    # the next block's budget leaves 1.25 x the working set at the cap (about 27 GiB), not at 1,500 tokens
    expect = 60 * gib - int(1.25 * rate * cap_tokens) - 5 * gib
    assert dense_update.cache_budget(model, device=torch.device("cuda"), max_tokens=cap_tokens) == expect
    longer_ws = int(rate * cap_tokens)  # what the step at the cap needs, growing with its tokens
    assert 60 * gib - expect - 5 * gib >= longer_ws > 2.5 * 10 * gib  # the old rule reserved 12.5 GiB
    # a block that measures a higher rate raises it for the next; a lower one leaves it
    peak[0] = 2 * gib + 40 * gib
    with dense_update.update_cache(model, gib=0.0, tokens=cap_tokens, max_tokens=cap_tokens):
        pass  # gib=0: off, nothing measured
    assert dense_update._working_set[model] == rate
    with dense_update.update_cache(model, tokens=cap_tokens, max_tokens=cap_tokens):
        pass
    higher = dense_update._working_set[model]
    assert higher == pytest.approx(40 * gib / cap_tokens) and higher > rate
    peak[0] = 2 * gib + 1 * gib
    with dense_update.update_cache(model, tokens=cap_tokens, max_tokens=cap_tokens):
        pass
    assert dense_update._working_set[model] == higher
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        with dense_update.update_cache(model, max_tokens=0):
            pass


def test_an_error_in_the_block_frees_the_dense_copies_and_empties_the_allocator(monkeypatch):
    model, ids, gib = _policy("nvfp4"), _batch(), dense_update.GIB
    emptied = _fake_cuda(monkeypatch, [40 * gib], 2 * gib, [9 * gib])
    dense_update._working_set[model] = 1.0  # measured before: this block caches
    for own, expect in ((True, [1]), (False, [])):
        emptied.clear()
        with pytest.raises(torch.OutOfMemoryError):
            with dense_update.update_cache(model, own_allocator=own) as block:
                _train_pass(model, ids, passes=1)
                assert block.bytes_held > 0
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        assert dense_cache._block is None and not block.entries and block.bytes_held == 0 and block.peak_bytes > 0
        assert emptied == expect  # only for an engine with its own allocator, after an error too
    assert dense_update._working_set[model] == 1.0  # an interrupted block measures nothing


def test_the_step_block_is_sized_from_the_batch_and_the_engine(monkeypatch):
    from types import SimpleNamespace

    from qerl_kit import step_phases
    from qerl_kit.rollout.base import Engine, ModelEngine

    seen = []
    monkeypatch.setattr(dense_update, "update_cache", lambda model, gib, **kw: seen.append((gib, kw)))
    cfg = from_dict({"loss": {"micro_batch": 4}, "rollout": {"max_new_tokens": 64}, "model": {"dense_cache_gib": 2}})
    batch = SimpleNamespace(prompt_ids=torch.zeros(6, 10), completion_ids=torch.zeros(6, 30))
    step_phases.dense_block(None, cfg, batch, object.__new__(ModelEngine))
    step_phases.dense_block(None, cfg, SimpleNamespace(prompt_ids=torch.zeros(2, 10), completion_ids=torch.zeros(2, 80)),
                            object.__new__(Engine))
    assert seen == [(2.0, dict(tokens=4 * 40, max_tokens=4 * 74, own_allocator=False)),
                    (2.0, dict(tokens=2 * 90, max_tokens=2 * 90, own_allocator=True))]  # 2 rows; C past the cap
    # with the step's micro-batches: the widest one once trimmed (the block measures that forward's working
    # set), here rows 2-5 (4 rows x (8 prompt + 30 completion) tokens), not 4 x (10 + 30)
    prompt_mask = torch.ones(6, 10)
    prompt_mask[:, :2] = 0  # every prompt 8 tokens: two columns of padding in every row
    completion_mask = (torch.arange(30)[None, :] < torch.tensor([5, 5, 9, 9, 12, 30])[:, None]).float()
    wide = SimpleNamespace(prompt_ids=torch.zeros(6, 10), completion_ids=torch.zeros(6, 30), prompt_mask=prompt_mask,
                           completion_mask=completion_mask)
    step_phases.dense_block(None, cfg, wide, object.__new__(ModelEngine), [slice(0, 2), slice(2, 6)])
    assert seen[-1] == (2.0, dict(tokens=4 * 38, max_tokens=4 * 74, own_allocator=False))


def test_a_run_resumes_with_dense_cache_gib_changed_exactly(tmp_path):
    """model.dense_cache_gib is resume-neutral: a run saved with the cache off (after an OOM, say)
    resumes with it on, without allow_config_change, and continues as the uninterrupted run."""
    from tests.test_old_policy import _timing
    from tests.test_rollout import make_tokenizer
    from tests.test_trainer import TASK, _config

    from qerl_kit.checkpoint import config_changes
    from qerl_kit.config import TrainConfig
    from qerl_kit.trainer import Trainer

    def trainer(path, gib):
        cfg = _config(path, save_every=2, model={"lora_r": 4, "dense_cache_gib": gib})
        return Trainer(_policy("nvfp4"), make_tokenizer(), TASK, cfg, progress="none")

    assert config_changes(TrainConfig().to_dict(), TrainConfig(model=dict(dense_cache_gib=0)).to_dict()) == {}
    full = trainer(tmp_path / "full", None).train(4)
    trainer(tmp_path / "killed", 0).train(3)
    resumed = trainer(tmp_path / "killed", None)
    assert resumed.resume(resumed.output_dir / "checkpoint-2") == 2
    resumed.train(2)
    assert [r["memory/dense_cache_gib"] > 0 for r in resumed.history] == [False, False, True, True]
    for a, b in zip(resumed.history, full.history, strict=True):  # the saved steps ran without the cache
        same = [k for k in a if not _timing(k) and k != "memory/dense_cache_gib"]
        assert set(a) == set(b) and {k: a[k] for k in same} == {k: b[k] for k in same}
    pa, pb = dict(resumed.model.named_parameters()), dict(full.model.named_parameters())
    assert all(torch.equal(p, pb[n]) for n, p in pa.items())


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
