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
