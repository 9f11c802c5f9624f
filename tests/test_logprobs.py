"""Chunked log-probs: the same values and gradients as the one-shot log-softmax."""

import torch

from qerl_kit.logprobs import token_logprobs


def _reference(logits, ids, T):
    logp = torch.log_softmax(logits.float() / T, dim=-1)
    return logp.gather(-1, ids[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_chunked_values_and_entropy_match_the_one_shot_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=g) * 4
    ids = torch.randint(50, (3, 11), generator=g)
    want, want_ent = _reference(logits, ids, 0.7)
    for chunk in (1, 4, 11, None):
        got, ent = token_logprobs(logits, ids, 0.7, with_entropy=True, chunk=chunk)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(ent, want_ent)


def test_chunked_gradient_matches_and_backward_recomputes_chunks():
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 9, 40, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(40, (2, 9), generator=g)
    weights = torch.randn(2, 9, generator=g)
    a = base.clone().requires_grad_(True)
    (token_logprobs(a, ids, 1.3, chunk=2) * weights).sum().backward()
    b = base.clone().requires_grad_(True)
    (_reference(b, ids, 1.3)[0] * weights).sum().backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.float(), b.grad.float())
    assert a.grad.abs().sum() > 0


def test_entropy_under_autograd_has_no_gradient_and_leaves_the_logp_gradient_alone():
    """One training forward gives log-probs with gradient and the entropy without (the Trainer's
    folded old-policy pass), chunked (checkpointed) or not, with the no-grad values bit for bit."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 9, 40, generator=g) * 3
    ids = torch.randint(40, (2, 9), generator=g)
    weights = torch.randn(2, 9, generator=g)
    for chunk in (2, None):  # 2: checkpointed chunks; None: one chunk, its log-softmax kept for backward
        with torch.no_grad():
            want, want_ent = token_logprobs(base, ids, 0.9, with_entropy=True, chunk=chunk)
        grads = []
        for with_entropy in (True, False):
            x = base.clone().requires_grad_(True)
            out = token_logprobs(x, ids, 0.9, with_entropy=with_entropy, chunk=chunk)
            logp = out[0] if with_entropy else out
            assert torch.equal(logp.detach(), want)
            if with_entropy:
                assert not out[1].requires_grad and torch.equal(out[1], want_ent)
            (logp * weights).sum().backward()
            grads.append(x.grad)
        assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
        torch.testing.assert_close(want_ent, _reference(base, ids, 0.9)[1])


# -- completion_logprobs on a micro-batch's own width (trim) ------------------------------------------

def _padded_rows(seed=3, vocab=500):
    """Four rows of a left-padded prompt (width 9) and a right-padded completion (width 12): prompts of
    5, 7, 3 and 6 tokens, completions of 4, 2, 6 and 1, so columns 0-1 and 6-11 are padding everywhere
    in this micro-batch (the batch they came from was wider)."""
    g = torch.Generator().manual_seed(seed)
    P, C, plen, clen = 9, 12, [5, 7, 3, 6], [4, 2, 6, 1]
    prompt_ids = torch.randint(3, vocab, (4, P), generator=g)
    completion_ids = torch.randint(3, vocab, (4, C), generator=g)
    pm = torch.tensor([[0] * (P - n) + [1] * n for n in plen])
    cm = torch.tensor([[1] * n + [0] * (C - n) for n in clen])
    return prompt_ids * pm, pm, completion_ids * cm, cm


def test_padding_bounds_cut_only_columns_that_are_padding_in_every_row():
    from qerl_kit.logprobs import padding_bounds

    _, pm, _, cm = _padded_rows()
    assert padding_bounds(pm, cm) == (2, 6)
    assert padding_bounds(torch.ones(2, 4), torch.ones(2, 3)) == (0, 3)  # nothing to cut
    assert padding_bounds(torch.zeros(2, 4), torch.zeros(2, 3)) == (3, 1)  # all padding: one column of each
    assert padding_bounds(torch.tensor([[0, 0, 1]]), torch.tensor([[0, 0]])) == (2, 1)  # no completion token
    assert padding_bounds(torch.tensor([[0, 0]]), torch.tensor([[1, 1, 0]])) == (1, 2)  # the prompt all padding


def test_trimmed_log_probs_and_entropy_are_the_untrimmed_ones_with_zeros_where_all_rows_pad():
    from qerl_kit.logprobs import completion_logprobs
    from tests.tiny_policy import tiny_policy

    model = tiny_policy("nvfp4")
    rows = _padded_rows()
    cm = rows[3].float()
    with torch.no_grad():
        full, full_ent = completion_logprobs(model, *rows, temperature=0.7, with_entropy=True, trim=False)
        cut, cut_ent = completion_logprobs(model, *rows, temperature=0.7, with_entropy=True)
    assert cut.shape == full.shape == (4, 12) and cut_ent.shape == full_ent.shape
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5)  # float32: the same values, another matmul shape
    torch.testing.assert_close(cut_ent * cm, full_ent * cm, rtol=1e-5, atol=1e-5)
    assert (cut[:, 6:] == 0).all() and (cut_ent[:, 6:] == 0).all() and (full_ent[:, 6:] != 0).any()
    assert (cut * cm).ne(0).sum() == cm.sum()  # every real token has a log-prob


def test_trimmed_gradients_match_the_untrimmed_ones():
    from qerl_kit.logprobs import completion_logprobs
    from tests.tiny_policy import tiny_policy

    model = tiny_policy("nvfp4")
    rows = _padded_rows(seed=4)
    grads = []
    for trim in (False, True):
        model.zero_grad(set_to_none=True)
        completion_logprobs(model, *rows, temperature=1.0, trim=trim).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)


def test_the_aligned_layout_gives_the_masked_layouts_log_probs_entropy_and_gradients():
    """aligned (the default): rows moved to column 0, no mask, the head on completion positions only; the
    padded, masked layout is the reference (rows of 5, 7, 3 and 6 prompt tokens: every row shifts)."""
    from qerl_kit import logprobs
    from tests.tiny_policy import tiny_policy

    model = tiny_policy("nvfp4", seed=5)
    rows = _padded_rows(seed=6)
    head = logprobs.output_head(model)
    shapes = []
    head.register_forward_hook(lambda _m, _args, out: shapes.append(tuple(out.shape)))
    got = {}
    for aligned in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.completion_logprobs(model, *rows, temperature=0.8, with_entropy=True, aligned=aligned)
        (logp * torch.linspace(0.5, 1.5, logp.shape[1])).sum().backward()
        got[aligned] = logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert shapes == [(4, 13, 512), (4, 6, 512)]  # trimmed width 7 + 6; aligned: the 6 completion columns only
    cm = rows[3].float()
    torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[True][1] * cm, got[False][1] * cm, rtol=1e-5, atol=1e-5)
    assert (got[True][0] * cm).ne(0).sum() == cm.sum() and len(got[True][2]) > 0
    for name, grad in got[False][2].items():
        torch.testing.assert_close(got[True][2][name], grad, rtol=1e-4, atol=1e-6)


def test_the_aligned_layout_takes_any_prompt_padding_as_the_mask_does():
    """Not only left padding: a right-padded prompt and one with a hole give what the same prompts
    left-padded give (the masked layout's reference): the padding never attended, positions from the
    mask's count. (The masked layout itself scores a right-padded prompt's first completion token from a
    padding column: only left padding is right there.)"""
    from qerl_kit import logprobs
    from tests.tiny_policy import tiny_policy

    model = tiny_policy("nvfp4", seed=2)
    prompt_ids, _, completion_ids, cm = _padded_rows(seed=8)
    pm = torch.tensor([[1] * 5 + [0] * 4, [0, 1, 1, 0, 0, 1, 1, 1, 1], [0] * 6 + [1] * 3, [1] * 9])
    ids = prompt_ids * pm + 3 * (1 - pm)  # padding ids that are real tokens elsewhere
    left = [torch.cat([torch.full((int((1 - m).sum()),), 3), row[m.bool()]]) for row, m in zip(ids, pm)]
    left_pm = torch.stack([torch.sort(m, stable=True).values for m in pm])  # the same counts, left-padded
    with torch.no_grad():
        want = logprobs.completion_logprobs(model, torch.stack(left), left_pm, completion_ids, cm, aligned=False)
        got = logprobs.completion_logprobs(model, ids, pm, completion_ids, cm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got * cm).ne(0).sum() == cm.sum()


def test_the_aligned_layout_needs_an_output_head_that_makes_the_logits():
    import pytest

    from qerl_kit import logprobs
    from tests.tiny_policy import tiny_policy

    model = tiny_policy("nvfp4")
    rows = _padded_rows()
    with torch.no_grad():
        want = logprobs.completion_logprobs(model, *rows, aligned=False)

    class Wrapped(torch.nn.Module):  # no get_output_embeddings: the masked layout
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return self.inner(**kw)

    with torch.no_grad():
        torch.testing.assert_close(logprobs.completion_logprobs(Wrapped(model), *rows), want)
    decoy = torch.nn.Linear(4, 4)  # an output head the forward never calls: refused, not wrong
    model.get_output_embeddings = lambda: decoy
    with torch.no_grad(), pytest.raises(RuntimeError, match="not one row per completion token"):
        logprobs.completion_logprobs(model, *rows)


def test_micro_batches_group_rows_by_length_and_keep_the_order_where_it_is_sorted():
    import pytest

    from qerl_kit.logprobs import micro_batches

    _, pm, _, cm = _padded_rows()  # completions of 4, 2, 6, 1; prompts of 5, 7, 3, 6
    groups = micro_batches(pm, cm, 2)
    assert [g.tolist() for g in groups] == [[1, 3], [0, 2]]  # lengths 1, 2 | 4, 6
    assert micro_batches(pm, cm, 2, "batch") == [slice(0, 2), slice(2, 4)]
    assert micro_batches(pm, cm, 4) == [slice(0, 4)]  # one micro-batch: nothing to regroup
    equal = torch.ones(5, 3)
    assert micro_batches(equal, equal, 2) == [slice(0, 2), slice(2, 4), slice(4, 6)]  # fixed lengths: as before
    # rows 0 and 1 complete 2 tokens, row 2 one; among the ties the shorter prompt (row 1) goes first
    ties = micro_batches(torch.tensor([[1, 1], [0, 1], [0, 1]]), torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]]), 2)
    assert [g.tolist() for g in ties] == [[1, 2], [0]]
    with pytest.raises(ValueError, match="loss.micro_batch_order"):
        micro_batches(pm, cm, 2, "random")


def test_packed_micro_batches_fill_the_padded_micro_batchs_tokens():
    from qerl_kit.logprobs import micro_batch_tokens, micro_batches

    prompts = torch.ones(6, 2, dtype=torch.long)  # 2 prompt tokens each; completions 1, 1, 1, 1, 8, 8
    completions = (torch.arange(8)[None, :] < torch.tensor([1, 1, 1, 1, 8, 8])[:, None]).long()
    packed = micro_batches(prompts, completions, 2, "packed")
    assert [g.tolist() for g in packed] == [[0, 1, 2, 3], [4, 5]]  # 4 x (2 + 1) and 2 x (2 + 8) <= 2 x 10
    assert len(micro_batches(prompts, completions, 2, "length")) == 3
    assert micro_batch_tokens(prompts, completions, packed) == [12, 20]
    equal = torch.ones(5, 3)
    assert micro_batches(equal, equal, 2, "packed") == [slice(0, 2), slice(2, 4), slice(4, 6)]  # nothing to pack


def test_packed_micro_batches_never_exceed_the_budget_and_hold_every_row_once():
    from qerl_kit.logprobs import micro_batch_tokens, micro_batches

    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        n, P, C, size = 3 + trial % 17, 1 + trial % 5, 1 + (trial * 7) % 23, 1 + trial % 4
        plen = torch.randint(0, P + 1, (n,), generator=g)
        clen = torch.randint(0, C + 1, (n,), generator=g)
        pm = (torch.arange(P)[None, :] >= (P - plen)[:, None]).long()  # left-padded prompts
        cm = (torch.arange(C)[None, :] < clen[:, None]).long()         # right-padded completions
        packed = micro_batches(pm, cm, size, "packed")
        rows = sorted(r for grp in packed for r in torch.arange(n)[grp].tolist())
        assert rows == list(range(n))
        assert max(micro_batch_tokens(pm, cm, packed)) <= size * (P + C)
        assert len(packed) <= len(micro_batches(pm, cm, size, "length"))


def _columns(pm, cm):
    """padding_bounds by its definition: the first and one past the last column that is real in some row."""
    p, c = pm.shape[1], cm.shape[1]
    real = torch.cat([pm, cm], dim=1).any(0).nonzero().flatten().tolist()
    if not real:
        return max(0, p - 1), min(1, c)
    end = max(1, real[-1] + 1 - p) if real[-1] >= p else min(1, c)
    return min(real[0], max(0, p - 1)), min(end, c)


def test_micro_batch_plan_bounds_equal_each_groups_padding_bounds():
    from qerl_kit.logprobs import micro_batch_plan, micro_batch_tokens, padding_bounds

    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        n, P, C, size = 1 + trial % 9, trial % 4, trial % 6, 1 + trial % 3
        pm = (torch.rand(n, P, generator=g) < 0.6).long()  # any masks: holes and empty rows too
        cm = (torch.rand(n, C, generator=g) < 0.5).long()
        if trial % 2:  # and the engine's layout: left-padded prompts, right-padded completions
            pm = (torch.arange(P)[None, :] >= torch.randint(0, P + 1, (n, 1), generator=g)).long()
            cm = (torch.arange(C)[None, :] < torch.randint(0, C + 1, (n, 1), generator=g)).long()
        for order in ("length", "batch", "packed"):
            groups, bounds = micro_batch_plan(pm, cm, size, order)
            assert bounds == [padding_bounds(pm[grp], cm[grp]) for grp in groups], (trial, order)
            assert bounds == [_columns(pm[grp], cm[grp]) for grp in groups], (trial, order)
            assert micro_batch_tokens(pm, cm, groups) == micro_batch_tokens(pm, cm, groups, bounds)


def test_batched_logprobs_over_sorted_micro_batches_returns_the_batch_order():
    from types import SimpleNamespace

    from qerl_kit.logprobs import batched_logprobs, micro_batches
    from tests.tiny_policy import tiny_policy

    model = tiny_policy("nvfp4")
    rows = SimpleNamespace(**dict(zip(("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"),
                                      _padded_rows(seed=5))))
    in_order = batched_logprobs(model, rows, 1.0, 4)
    sorted_rows = batched_logprobs(model, rows, 1.0, micro_batches(rows.prompt_mask, rows.completion_mask, 2))
    torch.testing.assert_close(sorted_rows, in_order, rtol=1e-5, atol=1e-5)
    assert (in_order != 0).sum() == rows.completion_mask.sum()


def test_micro_batch_tokens_count_each_micro_batch_at_its_trimmed_width():
    from qerl_kit.logprobs import micro_batch_tokens, widest_tokens

    _, pm, _, cm = _padded_rows()  # rows 0-1: prompts 5, 7 and completions 4, 2; rows 2-3: 3, 6 and 6, 1
    halves = [slice(0, 2), slice(2, 4)]
    assert micro_batch_tokens(pm, cm, halves) == [2 * (7 + 4), 2 * (6 + 6)]
    assert widest_tokens(pm, cm, halves) == 24 and widest_tokens(pm, cm, []) == 1
    assert micro_batch_tokens(pm, cm, [torch.tensor([1, 3])]) == [2 * (7 + 2)]  # row indices too
