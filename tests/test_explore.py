"""The exploration probe behind the AQN panel: deterministic per sigma, restores the exact weights,
and more noise means more entropy and more distinct samples on the shipped tiny model."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from qerl_kit.aqn import AQN  # noqa: E402
from qerl_kit.explore import exploration_probe, sweep  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from qerl_kit.data import build_prompt
    from qerl_kit.tasks.arith import make_dataset
    from qerl_kit.tasks.arith import PROMPT_SUFFIX
    from qerl_kit.tiny import load_tiny

    model, tok = load_tiny(quantize="nvfp4")
    rows = make_dataset("test", 2, seed=0, levels=(3,))
    prompts = [build_prompt(tok, r["prompt"], suffix=PROMPT_SUFFIX) for r in rows]
    return model, tok, prompts, [r["answer"] for r in rows]


def test_probe_is_deterministic_and_restores_the_clean_weights(tiny):
    model, tok, prompts, answers = tiny
    before = {k: v.clone() for k, v in model.state_dict().items() if v.dtype.is_floating_point}
    probe = exploration_probe(model, tok, prompts, AQN(), n=4, max_new_tokens=24, answers=answers)
    a, b = probe(0.05), probe(0.05)
    assert a == b
    assert set(a) == {"entropy", "distinct", "mean_length", "accuracy"}
    assert 1 / 4 <= a["distinct"] <= 1 and 0 <= a["accuracy"] <= 1 and a["entropy"] >= 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-exact, noise never stays


def test_more_noise_explores_more(tiny):
    model, tok, prompts, _ = tiny
    probe = exploration_probe(model, tok, prompts, n=6, max_new_tokens=24)
    rows = sweep(probe, [0.0, 0.3])
    assert [r["sigma"] for r in rows] == [0.0, 0.3]
    assert rows[1]["entropy"] > rows[0]["entropy"]
    assert rows[1]["distinct"] >= rows[0]["distinct"]


def test_probe_rejects_bad_arguments(tiny):
    model, tok, prompts, _ = tiny
    with pytest.raises(ValueError, match="n must be >= 2"):
        exploration_probe(model, tok, prompts, n=1)
    with pytest.raises(ValueError, match="at least one prompt"):
        exploration_probe(model, tok, [])
    with pytest.raises(ValueError, match="answers"):
        exploration_probe(model, tok, prompts, answers=["1"])
    with pytest.raises(ValueError, match=r"^sigma must be a finite float in \[0, 10\].*got -"):
        exploration_probe(model, tok, prompts, n=2, max_new_tokens=2)(-1.0)
