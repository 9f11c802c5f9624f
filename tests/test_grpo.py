"""Tests for qerl_kit.grpo and qerl_kit.sampling_filters (pure tensor RL math, CPU, < 2 s).

Run: cd /work/main && source .venv/bin/activate && PYTHONPATH=. python -m pytest tests/test_grpo.py -q

Hand-computed examples pin the numbers; property tests use fresh random (never zero) inputs.
"""

import math

import pytest
import torch

from qerl_kit import sampling_filters
from qerl_kit.grpo import (
    LOSSES,
    KeptGroups,
    LossSpec,
    accumulate_groups,
    clip_stats,
    combine_rewards,
    dapo_loss,
    dr_grpo_loss,
    filter_groups,
    frac_reward_zero_std,
    group_advantages,
    grpo_loss,
    importance_weights,
    kl_k3,
    overlong_penalty,
    register_loss,
)

LN2, LN4, LN15 = math.log(2.0), math.log(4.0), math.log(1.5)


def close(actual, expected, atol=1e-6):
    actual = torch.as_tensor(actual, dtype=torch.float32)
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=atol, equal_nan=True), f"\nactual   {actual}\nexpected {expected}"


# ----------------------------------------------------------------------------- hand example
# B = 2, T = 3. Sequence 0: A = +1, all 3 tokens active, ratios 1.5, 0.5, 1.1.
# Sequence 1: A = -2, tokens 0-1 active, ratios 0.5, 1.5; token 2 is padding with ratio 0.1.
RATIOS = [[1.5, 0.5, 1.1], [0.5, 1.5, 0.1]]
ADV = [1.0, -2.0]
MASK = [[1, 1, 1], [1, 1, 0]]


def hand_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(2, 3, generator=g) - 0.5                   # any old log-probs
    logp = (old + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return logp, old, torch.tensor(ADV), torch.tensor(MASK)


def test_grpo_loss_hand_example_and_gradient():
    logp, old, adv, mask = hand_batch()
    # eps 0.2/0.2. Per-token -min(rA, clip(r)A):
    # seq 0 (A=+1): r=1.5 -> clip 1.2 -> -1.2 (clipped high, grad 0); r=0.5 -> -0.5; r=1.1 -> -1.1
    # seq 1 (A=-2): r=0.5 -> max(r, 0.8) * 2 = 1.6 (clipped low, grad 0); r=1.5 -> 3.0
    # grpo = mean(-2.8/3, 4.6/2)
    loss = grpo_loss(logp, old, adv, mask)
    close(loss, (-2.8 / 3 + 4.6 / 2) / 2)
    loss.backward()
    # d/dlogp of -r*A = -A*r, divided by (B * L_b): seq 0 by 2*3, seq 1 by 2*2
    close(logp.grad, [[0.0, -0.5 / 6, -1.1 / 6], [0.0, 3.0 / 4, 0.0]])


def test_dapo_loss_hand_example_and_gradient():
    logp, old, adv, mask = hand_batch()
    # default eps_high = 0.28: seq 0 token 0 is clipped at 1.28 instead of 1.2
    # sum = -1.28 - 0.5 - 1.1 + 1.6 + 3.0 = 1.72 over 5 active tokens
    loss = dapo_loss(logp, old, adv, mask)
    close(loss, 1.72 / 5)
    loss.backward()
    close(logp.grad, [[0.0, -0.5 / 5, -1.1 / 5], [0.0, 3.0 / 5, 0.0]])


def test_dr_grpo_loss_hand_example_and_gradient():
    logp, old, adv, mask = hand_batch()
    # eps 0.2: sum = -2.8 + 4.6 = 1.8, divided by B * T = 6
    loss = dr_grpo_loss(logp, old, adv, mask)
    close(loss, 1.8 / 6)
    loss.backward()
    close(logp.grad, [[0.0, -0.5 / 6, -1.1 / 6], [0.0, 3.0 / 6, 0.0]])
    # a fixed max_completion_length replaces T
    logp2, old2, adv2, mask2 = hand_batch()
    close(dr_grpo_loss(logp2, old2, adv2, mask2, max_len=4), 1.8 / 8)


def test_dapo_num_tokens_overrides_normalizer():
    logp, old, adv, mask = hand_batch()
    close(dapo_loss(logp, old, adv, mask, num_tokens=10), 1.72 / 10)


def test_eps_high_defaults_to_eps_low_and_can_differ():
    logp, old, adv, mask = hand_batch()
    # grpo with eps_high 0.28: seq 0 mean = (-1.28 - 0.5 - 1.1)/3, seq 1 unchanged (clip-high irrelevant for A<0 here)
    close(grpo_loss(logp, old, adv, mask, eps_high=0.28), ((-2.88) / 3 + 4.6 / 2) / 2)
    # dapo with eps_high=None uses eps_low = 0.2 -> sum 1.8 over 5 tokens
    close(dapo_loss(logp, old, adv, mask, eps_high=None), 1.8 / 5)
    # eps_low = 0.6: seq 1 token 0 (r=0.5) is now clipped at 0.4 -> max(0.5, 0.4)*2 = 1.0, not clipped
    close(dr_grpo_loss(logp, old, adv, mask, eps_low=0.6, eps_high=0.2), (-2.8 + 1.0 + 3.0) / 6)


def test_clip_stats_hand_example():
    logp, old, adv, mask = hand_batch()
    s = clip_stats(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # low: seq 1 token 0 (r=0.5, A<0); the padded token (r=0.1, A<0) must not count.
    # high: seq 0 token 0 (r=1.5, A>0). seq 0 token 1 (r=0.5 but A>0) is not a low clip.
    assert s["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert s["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert s["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert s["clip_ratio/low_min"] == pytest.approx(0.0)     # per-seq low shares: 0, 1/2
    assert s["clip_ratio/high_max"] == pytest.approx(1 / 3)  # per-seq high shares: 1/3, 0
    # eps_high 0.28 does not change it (1.5 > 1.28); eps_high 0.6 removes the high clip
    assert clip_stats(logp, old, adv, mask, 0.2, 0.6)["clip_ratio/high_mean"] == 0.0


# ----------------------------------------------------------------------------- KL
def test_kl_k3_hand_value_and_in_loss():
    # d = ref - logp = ln2, -ln2, (padding): k3 = (2 - ln2 - 1) and (0.5 + ln2 - 1) -> mean 0.25 exactly
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = logp + torch.tensor([[LN2, -LN2, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    close(kl_k3(logp, ref, mask), 0.25)
    # inside the loss: ratio 1 and A = 0, so only beta * KL remains (grpo: per-sequence token mean)
    lp = logp.clone().requires_grad_(True)
    loss = grpo_loss(lp, logp, torch.zeros(1), mask, ref_logp=ref, beta=0.1)
    close(loss, 0.1 * 0.25)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp): -1 and +0.5, times beta / 2 tokens
    close(lp.grad, [[-0.1 / 2, 0.05 / 2, 0.0]])
    # beta = 0 ignores ref_logp entirely
    close(grpo_loss(logp, logp, torch.zeros(1), mask, ref_logp=ref, beta=0.0), 0.0)


def test_kl_is_aggregated_like_the_loss():
    torch.manual_seed(1)
    B, T = 3, 5
    logp = -torch.rand(B, T) - 0.1
    ref = logp + 0.3 * torch.randn(B, T)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    zero_adv = torch.zeros(B)
    k3 = (torch.exp(ref - logp) - (ref - logp) - 1) * mask
    beta = 0.04
    close(dapo_loss(logp, logp, zero_adv, mask, ref_logp=ref, beta=beta), beta * k3.sum() / mask.sum())
    close(dr_grpo_loss(logp, logp, zero_adv, mask, ref_logp=ref, beta=beta), beta * k3.sum() / (B * T))
    close(grpo_loss(logp, logp, zero_adv, mask, ref_logp=ref, beta=beta),
          beta * (k3.sum(1) / mask.sum(1)).mean())
    assert float(kl_k3(logp, ref, mask)) >= 0


# ----------------------------------------------------------------------------- properties (random inputs)
def random_batch(B=4, T=6, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, generator=g) + 0.1
    lengths = lengths or [T] * B
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dapo_equals_grpo_equals_dr_grpo_with_equal_full_lengths(seed):
    logp, old, adv, mask = random_batch(seed=seed)
    kw = dict(eps_low=0.2, eps_high=0.25)
    g = grpo_loss(logp, old, adv, mask, **kw)
    close(dapo_loss(logp, old, adv, mask, **kw), g)
    close(dr_grpo_loss(logp, old, adv, mask, **kw), g)


def test_dapo_equals_grpo_with_equal_lengths_and_padding():
    logp, old, adv, mask = random_batch(lengths=[4, 4, 4, 4])
    close(dapo_loss(logp, old, adv, mask, eps_high=0.2), grpo_loss(logp, old, adv, mask))


def test_losses_differ_with_unequal_lengths():
    logp, old, adv, mask = random_batch(lengths=[6, 2, 5, 1])
    g, d = grpo_loss(logp, old, adv, mask), dapo_loss(logp, old, adv, mask, eps_high=0.2)
    assert not torch.allclose(g, d)
    # dr_grpo = dapo * (active tokens) / (B * T) with the same eps
    close(dr_grpo_loss(logp, old, adv, mask), d * mask.sum() / (4 * 6))


@pytest.mark.parametrize("seed", [0, 3])
def test_ratio_one_loss_and_gradient(seed):
    lengths = [6, 3, 5, 2]
    logp, _, adv, mask = random_batch(seed=seed, lengths=lengths)
    L = torch.tensor(lengths, dtype=torch.float32)
    B, T = mask.shape
    expect_loss = {
        "grpo": -adv.mean(),
        "dapo": -(adv * L).sum() / L.sum(),
        "dr_grpo": -(adv * L).sum() / (B * T),
    }
    expect_grad = {
        "grpo": -adv[:, None] / (B * L[:, None]) * mask,
        "dapo": -adv[:, None] / L.sum() * mask,
        "dr_grpo": -adv[:, None] / (B * T) * mask,
    }
    for name, spec in LOSSES.items():
        fn = spec.fn
        lp = logp.detach().clone().requires_grad_(True)
        # old_logp = logp itself (not detached): the loss must treat it as a constant
        loss = fn(lp, lp, adv, mask)
        close(loss, expect_loss[name])
        loss.backward()
        close(lp.grad, expect_grad[name])


def test_registry():
    assert {k: (v.fn, v.normalizer) for k, v in LOSSES.items()} == {
        "grpo": (grpo_loss, "sequences"), "dapo": (dapo_loss, "tokens"), "dr_grpo": (dr_grpo_loss, "length")}
    with pytest.raises(ValueError, match="normalizer must be one of"):
        LossSpec(grpo_loss, "rows")


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_micro_batches_weighted_by_the_spec_add_up_to_the_whole_batch_loss(name):
    """What the Trainer does: each chunk's loss x chunk_weight, with the whole batch's normalizer."""
    spec = LOSSES[name]
    logp, old, adv, mask = random_batch(B=6, lengths=[6, 1, 3, 5, 2, 6])
    B, T = mask.shape
    normalizer = spec.batch_kwargs(mask.sum(), T)
    whole = spec.fn(logp, old, adv, mask, **normalizer)
    chunks = sum(spec.fn(logp[s:s + 4], old[s:s + 4], adv[s:s + 4], mask[s:s + 4], **normalizer)
                 * spec.chunk_weight(len(logp[s:s + 4]), B) for s in range(0, B, 4))
    close(chunks, whole)
    lp = logp.detach().clone().requires_grad_(True)
    spec.fn(lp, old, adv, mask, **normalizer).backward()
    assert lp.grad.abs().sum() > 0


def test_register_loss_adds_a_loss_the_config_accepts(monkeypatch):
    from qerl_kit.config import from_dict

    monkeypatch.setitem(LOSSES, "placeholder", LOSSES["grpo"])  # restored after the test
    spec = register_loss("placeholder", dapo_loss, "tokens")
    assert LOSSES["placeholder"] is spec and from_dict(dict(loss=dict(loss="placeholder"))).loss.loss == "placeholder"


def test_empty_sequence_and_garbage_padding_do_not_make_nan():
    logp, old, adv, mask = random_batch(lengths=[6, 0, 3, 0])
    with torch.no_grad():
        logp[1] = -math.inf           # a padded row full of -inf
        logp[2, 3:] = math.nan        # NaN under the mask
    ref = old.clone()
    ref[3] = math.inf
    w = torch.where(mask.bool(), 1.5, math.nan)  # IS weights that are NaN on padding
    for fn in (s.fn for s in LOSSES.values()):
        if logp.grad is not None:
            logp.grad = None
        loss = fn(logp, old, adv, mask, ref_logp=ref, beta=0.1, is_weights=w)
        loss.backward()
        assert torch.isfinite(loss)
        assert torch.isfinite(logp.grad).all()
        assert (logp.grad[1] == 0).all() and (logp.grad[2, 3:] == 0).all()
    all_empty = torch.zeros_like(mask)
    for fn in (s.fn for s in LOSSES.values()):
        close(fn(logp, old, adv, all_empty), 0.0)
    s = clip_stats(logp, old, adv, all_empty)
    assert all(v == 0.0 for v in s.values())
    close(kl_k3(logp, ref, all_empty), 0.0)


def test_bool_mask_and_bf16_inputs():
    logp, old, adv, mask = random_batch(lengths=[6, 3, 5, 2])
    a = dapo_loss(logp, old, adv, mask)
    b = dapo_loss(logp, old, adv, mask.bool())
    close(a, b)
    c = dapo_loss(logp.bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert c.dtype == torch.float32
    close(c, a, atol=5e-2)


# ----------------------------------------------------------------------------- IS weights
def is_batch():
    # diff = train_old - rollout. Row 1 token 2 is padding (diff 10 must be ignored).
    rollout = -torch.rand(2, 3) - 1.0
    diff = torch.tensor([[LN2, LN4, -LN2], [LN15, LN15, 10.0]])
    return rollout + diff, rollout, torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token_truncate", {}, [[2.0, 3.0, 0.5], [1.5, 1.5, 0.0]]),
        ("token_truncate", {"floor": 0.6}, [[2.0, 3.0, 0.6], [1.5, 1.5, 0.0]]),
        ("token_truncate", {"cap": None}, [[2.0, 4.0, 0.5], [1.5, 1.5, 0.0]]),
        ("token_mask", {}, [[2.0, 0.0, 0.5], [1.5, 1.5, 0.0]]),
        ("token_mask", {"floor": 0.6}, [[2.0, 0.0, 0.0], [1.5, 1.5, 0.0]]),
        # sequence ratios: exp(ln2 + ln4 - ln2) = 4, exp(2 ln1.5) = 2.25
        ("sequence_truncate", {}, [[3.0, 3.0, 3.0], [2.25, 2.25, 0.0]]),
        ("sequence_mask", {}, [[0.0, 0.0, 0.0], [2.25, 2.25, 0.0]]),
        ("sequence_mask", {"cap": 5.0}, [[4.0, 4.0, 4.0], [2.25, 2.25, 0.0]]),
    ],
)
def test_importance_weights_modes(mode, kwargs, expected):
    train_old, rollout, mask = is_batch()
    w, _ = importance_weights(train_old, rollout, mask, mode=mode, **kwargs)
    close(w, expected, atol=1e-5)
    assert not w.requires_grad


def test_importance_weights_stats():
    train_old, rollout, mask = is_batch()
    _, s = importance_weights(train_old, rollout, mask)  # token_truncate, cap 3
    assert s["sampling/sampling_logp_difference/mean"] == pytest.approx((2 * LN2 + LN4 + 2 * LN15) / 5, abs=1e-5)
    assert s["sampling/sampling_logp_difference/max"] == pytest.approx(LN4, abs=1e-5)
    # after truncation: 2, 3, 0.5, 1.5, 1.5
    assert s["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5, abs=1e-5)
    assert s["sampling/importance_sampling_ratio/mean"] == pytest.approx(8.5 / 5, abs=1e-5)
    assert s["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0, abs=1e-5)
    # sequence modes: stats over the B sequence ratios (after masking): 0 and 2.25
    _, s = importance_weights(train_old, rollout, mask, mode="sequence_mask")
    assert s["sampling/importance_sampling_ratio/min"] == pytest.approx(0.0)
    assert s["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.125, abs=1e-5)
    assert s["sampling/importance_sampling_ratio/max"] == pytest.approx(2.25, abs=1e-5)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_without_stats_are_the_same_weights_and_read_nothing_back(mode, monkeypatch):
    """stats=False (OldPolicy.fill, per micro-batch): bit-equal weights, {} for stats, and no .item()."""
    g = torch.Generator().manual_seed(11)
    train_old, rollout = -torch.rand(5, 7, generator=g) * 3, -torch.rand(5, 7, generator=g) * 3
    mask = (torch.rand(5, 7, generator=g) > 0.3).long()
    nonzero = 0
    for kwargs in ({}, {"cap": 1.5, "floor": 0.7}, {"cap": None}):
        full, stats = importance_weights(train_old, rollout, mask, mode=mode, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", lambda self: pytest.fail("a host read with stats=False"))
            bare, none = importance_weights(train_old, rollout, mask, mode=mode, stats=False, **kwargs)
        assert torch.equal(bare, full) and none == {} and len(stats) == 5
        nonzero += int(full.count_nonzero())
    assert nonzero > 0


def test_identical_logps_give_unit_weights():
    torch.manual_seed(0)
    lp = -torch.rand(3, 4) - 0.1
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        w, s = importance_weights(lp, lp, mask, mode=mode)
        close(w, mask.float())
        assert s["sampling/sampling_logp_difference/max"] == 0.0


def test_is_weights_multiply_policy_term_not_kl():
    logp, _, adv, mask = random_batch(lengths=[6, 3, 5, 2])
    g = torch.Generator().manual_seed(7)
    w = (torch.rand(4, 6, generator=g) + 0.5).requires_grad_(True)  # must be detached inside
    ref = logp.detach() + 0.2 * torch.randn(4, 6, generator=g)
    n = mask.sum()
    lp = logp.detach().clone().requires_grad_(True)
    loss = dapo_loss(lp, lp, adv, mask, is_weights=w, ref_logp=ref, beta=0.5)
    k3 = (torch.exp(ref - lp.detach()) - (ref - lp.detach()) - 1) * mask
    close(loss, (-(w.detach() * adv[:, None] * mask).sum() + 0.5 * k3.sum()) / n)
    loss.backward()
    assert w.grad is None
    dk3 = (1 - torch.exp(ref - lp.detach())) * mask
    close(lp.grad, (-w.detach() * adv[:, None] * mask + 0.5 * dk3) / n)


# ----------------------------------------------------------------------------- rewards, advantages
def test_group_advantages_three_scales_hand_example():
    # G = 3. Group 0: [0, 1, 2], mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1. Group 1: [3, 3, 3].
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 3.0])
    centered = [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    close(group_advantages(r, 3, "group", eps=0.0), centered)
    close(group_advantages(r, 3, "group"), [x / (1 + 1e-4) for x in centered])  # default eps 1e-4
    # batch std of [0,1,2,3,3,3]: mean 2, squared deviations 4,1,0,1,1,1 -> 8 / 5 -> sqrt(1.6)
    close(group_advantages(r, 3, "batch", eps=0.0), [x / math.sqrt(1.6) for x in centered])
    close(group_advantages(r, 3, "none"), centered)


def test_group_std_is_unbiased_like_trl():
    # [0, 1]: population std 0.5 would give +-1; unbiased std sqrt(0.5) gives +-sqrt(0.5)
    close(group_advantages(torch.tensor([0.0, 1.0]), 2, eps=0.0), [-math.sqrt(0.5), math.sqrt(0.5)])


def test_group_advantages_nan_rewards():
    nan = math.nan
    # group 0: [1, NaN, 3]: mean 2, std sqrt(2) over the two valid values; NaN row -> 0
    # group 1: [NaN, 5, NaN]: one valid value -> std undefined -> all 0
    r = torch.tensor([1.0, nan, 3.0, nan, 5.0, nan])
    s2 = math.sqrt(2.0)
    close(group_advantages(r, 3, eps=0.0), [-1 / s2, 0.0, 1 / s2, 0.0, 0.0, 0.0])
    close(group_advantages(r, 3, "none"), [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    # batch std over the valid [1, 3, 5]: 2
    close(group_advantages(r, 3, "batch", eps=0.0), [-0.5, 0.0, 0.5, 0.0, 0.0, 0.0])


def test_combine_rewards_nansum_weights_and_unscorable_rows():
    per_fn = [[1.0, None, None, 0.5], [0.2, 0.3, None, None]]
    with pytest.warns(UserWarning, match=r"returned None for completion\(s\) \[2\]"):
        r = combine_rewards(per_fn, weights=[2.0, 1.0])
    close(r, [2.2, 0.3, 0.0, 1.0])
    with pytest.warns(UserWarning, match="returned None"):
        r = combine_rewards(per_fn, unscorable="nan")
    close(r, [1.2, 0.3, math.nan, 0.5])
    # a NaN reward (not applicable) in a group is left out of the baseline and gets advantage 0
    close(group_advantages(r, 2, "none"), [0.45, -0.45, 0.0, 0.0])
    close(combine_rewards([[1.0, 2.0]]), [1.0, 2.0])


def test_frac_reward_zero_std():
    nan = math.nan
    r = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 3.0, 5.0, 5.0, 5.0])
    assert frac_reward_zero_std(r, 3) == pytest.approx(2 / 3)
    # a group with one valid reward has undefined std and is not counted (as in TRL)
    assert frac_reward_zero_std(torch.tensor([nan, nan, 1.0, 2.0, 2.0, 2.0]), 3) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- dynamic sampling
def test_filter_groups():
    nan = math.nan
    r = torch.tensor([1, 1, 1, 0, 1, 0, nan, 2, 2, nan, nan, 3.0])
    assert filter_groups(r, 3).tolist() == [False, True, False, False]
    assert filter_groups(torch.tensor([0.0, 0.05, 1.0, 0.0]), 2, atol=0.1).tolist() == [False, True]


def test_accumulate_groups_until_target():
    s0 = KeptGroups()
    s1, done = accumulate_groups(s0, ["a0", "a1", "b0", "b1", "c0", "c1"], torch.tensor([1, 1, 0, 1, 1, 0.0]), 2, 3)
    assert not done and s1.num_groups == 2 and s1.rounds == 1
    assert s0.num_groups == 0  # immutable
    s2, done = accumulate_groups(s1, ["d0", "d1", "e0", "e1", "f0", "f1"], torch.tensor([0, 0, 1, 0, 0, 1.0]), 2, 3)
    assert done
    assert s2.items() == ["b0", "b1", "c0", "c1", "e0", "e1"]  # f passed the filter but the batch was full
    close(s2.reward_tensor(), [0, 1, 1, 0, 1, 0])
    assert (s2.rounds, s2.groups_seen, s2.groups_kept) == (2, 6, 4)
    assert s2.keep_rate == pytest.approx(4 / 6)


def test_accumulate_groups_round_limit_and_errors():
    with pytest.raises(RuntimeError, match="kept only 0/2 groups"):
        accumulate_groups(KeptGroups(), [0, 1, 2, 3], torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, 2, max_rounds=1)
    with pytest.raises(ValueError, match="must match one-to-one"):
        accumulate_groups(KeptGroups(), [0, 1, 2], torch.tensor([1.0, 0.0]), 2, 2)
    with pytest.raises(ValueError, match="exhausted must be"):
        accumulate_groups(KeptGroups(), [0, 1], torch.tensor([1.0, 0.0]), 2, 1, exhausted="retry")
    with pytest.raises(ValueError, match="group_size >= 2"):
        filter_groups(torch.tensor([1.0, 0.0]), 1)


def test_accumulate_groups_fills_at_the_round_limit_with_the_last_rounds_other_groups():
    rewards = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0.0])  # groups a (flat), b (spread), c (flat), d (flat)
    s1, done = accumulate_groups(KeptGroups(), ["a", "a", "b", "b", "c", "c", "d", "d"], rewards, 2, 3, max_rounds=2,
                                 exhausted="fill")
    assert not done and s1.items() == ["b", "b"] and s1.groups_filled == 0  # round 1 of 2: no fill yet
    s2, done = accumulate_groups(s1, ["e", "e", "f", "f", "g", "g", "h", "h"], torch.tensor([1, 1, 0, 0, 0, 1, 1, 1.0]),
                                 2, 3, max_rounds=2, exhausted="fill")
    # round 2: g passes the filter; the batch is then filled with e, the first flat group, in order
    assert done and s2.items() == ["b", "b", "g", "g", "e", "e"] and s2.groups_filled == 1
    assert (s2.groups_kept, s2.groups_seen) == (2, 8)
    close(s2.reward_tensor(), [0, 1, 0, 1, 1, 1])


def test_sampling_helpers_are_reexported():
    assert filter_groups is sampling_filters.filter_groups
    assert overlong_penalty is sampling_filters.overlong_penalty


# ----------------------------------------------------------------------------- overlong shaping
def test_overlong_penalty_boundaries():
    # max_len 20, buffer 4: zone starts after length 16, reaches -factor at 20, stays there beyond
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    close(overlong_penalty(lengths, 20, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty([0, 16, 17, 18, 20, 25], 20, 4, penalty_factor=0.5),
          [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    close(overlong_penalty([0, 3, 5], 5, 5), [0.0, -0.6, -1.0])  # buffer = max_len: starts at 0


def test_overlong_penalty_errors():
    for max_len, buf in [(20, 0), (20, 21)]:
        with pytest.raises(ValueError, match="0 < buffer_len <= max_len"):
            overlong_penalty([1], max_len, buf)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty([1], 20, 4, penalty_factor=-1.0)


# ----------------------------------------------------------------------------- error messages
def test_loss_input_errors():
    logp, old, adv, mask = random_batch()
    for fn in (s.fn for s in LOSSES.values()):
        with pytest.raises(ValueError, match="ref_logp"):
            fn(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match=r"old_logp must have shape \[B, T\]"):
        grpo_loss(logp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match=r"advantages must have shape \[B\]"):
        grpo_loss(logp, old, adv[:, None], mask)
    with pytest.raises(ValueError, match="mask must have shape"):
        dapo_loss(logp, old, adv, mask[:2])
    with pytest.raises(ValueError, match="is_weights must have shape"):
        dapo_loss(logp, old, adv, mask, is_weights=torch.ones(4, 1))
    with pytest.raises(ValueError, match="ref_logp must have shape"):
        dapo_loss(logp, old, adv, mask, ref_logp=old[0], beta=0.1)
    with pytest.raises(ValueError, match=r"logp must be a \[B, T\] tensor"):
        grpo_loss(logp[0], old[0], adv, mask[0])
    with pytest.raises(TypeError, match="old_logp must be a torch.Tensor"):
        grpo_loss(logp, old.tolist(), adv, mask)
    with pytest.raises(ValueError, match="eps_low"):
        grpo_loss(logp, old, adv, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        grpo_loss(logp, old, adv, mask, beta=-1.0, ref_logp=old)
    with pytest.raises(ValueError, match="max_len"):
        dr_grpo_loss(logp, old, adv, mask, max_len=0)


def test_other_input_errors():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.rand(6) + 0.1, 4)
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages(torch.rand(4) + 0.1, 2, scale="std")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.rand(2, 2) + 0.1, 2)
    train_old, rollout, mask = is_batch()
    with pytest.raises(ValueError, match="mode must be one of"):
        importance_weights(train_old, rollout, mask, mode="token")
    with pytest.raises(ValueError, match="rollout_logp must have shape"):
        importance_weights(train_old, rollout[:1], mask)
    with pytest.raises(ValueError, match="same completions"):
        combine_rewards([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="2 weights for 1 reward"):
        combine_rewards([[1.0, 2.0]], weights=[1.0, 2.0])
