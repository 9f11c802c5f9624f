"""policy_entropy: the formula, the masking, and entropy rising under AQN noise."""

import math

import pytest
import torch

from qerl_kit.aqn import AQN
from qerl_kit.entropy import entropy_from_logits, policy_entropy
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model


def test_entropy_formula_on_random_logits():
    logits = torch.randn(3, 7, 50) * 3
    p = torch.softmax(logits.double(), -1)
    expected = -(p * p.log()).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, chunk=4).double(), expected, atol=1e-5)
    assert entropy_from_logits(torch.zeros(2, 10)).allclose(torch.full((2,), math.log(10)))


class _FixedLogits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None, **_):
        return type("Out", (), {"logits": self.logits})()


def test_only_positions_that_sampled_completion_tokens_count():
    logits = torch.randn(2, 5, 11)
    ent = entropy_from_logits(logits)
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    got = policy_entropy(_FixedLogits(logits), torch.zeros(2, 5, dtype=torch.long), mask)
    # token t was sampled from the distribution at t-1
    expected = torch.cat([ent[0, 1:3], ent[1, 0:4]]).mean()
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    hot = policy_entropy(_FixedLogits(logits), torch.zeros(2, 5, dtype=torch.long), mask, temperature=0.5)
    assert hot < got  # lower temperature, sharper distribution
    with pytest.raises(ValueError, match="no completion tokens"):
        policy_entropy(_FixedLogits(logits), torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5))


def test_larger_sigma_raises_entropy_of_a_small_model():
    model = build_model("qwen2-tiny", seed=0, hidden_size=128, intermediate_size=256)
    with torch.no_grad():  # a confident (low-entropy) model, as a trained policy is
        model.lm_head.weight.mul_(20)
    quantize_model(model)
    ids = torch.randint(0, 512, (8, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    clean = policy_entropy(model, ids, mask).item()
    means = []
    for sigma in (0.2, 0.5):
        aqn = AQN(total_steps=100, seed=1)
        vals = []
        for _ in range(6):
            with aqn.noise(model, step=50, sigma=sigma):
                vals.append(policy_entropy(model, ids, mask).item())
        means.append(sum(vals) / len(vals))
    assert clean < means[0] < means[1], (clean, means)
    assert policy_entropy(model, ids, mask).item() == clean  # restored
