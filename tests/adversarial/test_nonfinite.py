"""NaN/inf stopped at their source, named; divergence said in the log (issue "Nothing silently wrong").

Cases 51, 82, 83, 116, 117, 121, 122 of the cases file, and the issue's behaviours: base weights
with NaN (every load path, ``format: none`` included), reward functions returning inf/NaN/an int too
large for a float (and sums beyond float32), non-finite logits at sampling time (sampled and
greedy), a non-finite loss or gradient in the trainer, no non-finite adapter written to a
checkpoint, and the divergence detector (``qerl_kit.divergence``: the rule, and a real tiny run at
a huge lr that prints it).
"""

import re
import shutil
import types
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_kit.grpo import combine_rewards, group_advantages
from qerl_kit.scoring import score_rollouts
from qerl_kit.tasks import Task
from tests.test_trainer import _trainer, first_char_reward

pytestmark = pytest.mark.usefixtures("one_thread")

N = 8


def _score(*fns):
    """score_rollouts of 2 groups of 4 stub completions with reward functions ``fns``."""
    task = Task("t", [{"prompt": "p", "answer": "a"}] * 2, [], fns, lambda tok, row: row["prompt"])
    rows = [{"prompt": "p", "answer": "a"}] * 2
    roll = types.SimpleNamespace(prompts=["p"] * N, texts=["a"] * N, completion_id_lists=lambda: [[1]] * N)
    return score_rollouts(task, rows, roll, 4)


def r_inf(completions, **_):
    return [float("inf")] + [0.5] * (len(completions) - 1)


def r_nan(completions, **_):
    return [0.5] * (len(completions) - 1) + [float("nan")]


def r_bigint(completions, **_):
    return [10**400] + [0] * (len(completions) - 1)


def r_huge(completions, **_):
    return [1e308] + [0.0] * (len(completions) - 1)


def test_case_51_reward_inf_is_an_error_naming_the_function_and_completion():
    with pytest.raises(ValueError, match=r"reward function 'r_inf'.*completion 0 is inf"):
        _score(first_char_reward, r_inf)


def test_reward_nan_is_an_error_naming_the_function():
    with pytest.raises(ValueError, match=r"'r_nan'.*completion 7 is nan.*None, not NaN"):
        _score(r_nan)


def test_case_121_int_too_large_names_the_function():
    with pytest.raises(ValueError, match=r"'r_bigint'.*completion 0 is an int too large for a float"):
        _score(r_bigint)


def test_case_122_two_huge_rewards_sum_beyond_float32_is_an_error_naming_both():
    def r_huge2(completions, **_):
        return r_huge(completions)

    with pytest.raises(ValueError, match=r"combined reward of completion 0 is inf \(r_huge=1e\+308, r_huge2=1e\+308\)"):
        _score(r_huge, r_huge2)
    with pytest.raises(ValueError, match="float32's range"):  # each finite in float32, their sum is not
        combine_rewards([[3e38, 0.0], [3e38, 0.0]])


def test_inf_reward_given_to_group_advantages_is_an_error_not_zero_advantages():
    with pytest.raises(ValueError, match="reward 1 is inf"):
        group_advantages(torch.tensor([0.0, float("inf"), 1.0, 0.0]), 4)
    big = group_advantages(torch.tensor([3e38, -3e38, 0.0, 0.0]), 4)  # finite, but squares overflow float32
    assert torch.isfinite(big).all() and big[0] > 1 and big[1] < -1


# ---- base weights --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nan_model_dir(tmp_path_factory):
    from qerl_kit.tiny import TINY_DIR

    d = tmp_path_factory.mktemp("nan_model") / "model"
    shutil.copytree(TINY_DIR, d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_case_116_eval_format_none_on_nan_weights_is_an_error_naming_the_tensor(nan_model_dir, capsys):
    from qerl_kit.cli import main

    assert main(["eval", "--model", str(nan_model_dir), "--format", "none", "--limit", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err  # one line, the last (after transformers' progress bar)
    assert re.search(r"^qerl eval: model '.*model': weight 'model.layers.1.mlp.down_proj.weight' is not finite "
                     r"\(1 NaN", err.splitlines()[-1])


def test_case_117_train_format_none_on_nan_weights_names_the_weights(nan_model_dir):
    from qerl_kit.build import build_policy
    from qerl_kit.config import ModelConfig
    from qerl_kit.tiny import load_tiny

    with pytest.raises(ValueError, match="down_proj.weight' is not finite"):
        build_policy(ModelConfig(name=str(nan_model_dir), format="none"))
    with pytest.raises(ValueError, match="down_proj.weight' is not finite"):  # the tiny loader on another path
        load_tiny(nan_model_dir)


# ---- logits at sampling time --------------------------------------------------------------------

@pytest.fixture(scope="module")
def blown_policy():
    """The tiny test policy after an lr-1e20 update: the adapter finite but |w| ~ 1e20."""
    from tests.test_trainer import _policy

    model = _policy()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.fill_(1e20)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_case_83_non_finite_logits_at_sampling_name_the_step_and_the_weights(blown_policy, temperature):
    from qerl_kit.rollout import HFEngine
    from qerl_kit.rollout.types import SamplingParams
    from tests.test_rollout import make_tokenizer

    eng = HFEngine(blown_policy, make_tokenizer())
    with pytest.raises(ValueError, match=r"logits are non-finite \(nan/inf\) at decode step 0.*max \|w\| = 1e\+20 "
                                         r"in '.*lora_.*'.*adapter/base weights"):
        eng.generate(["ab", "cd"], 2, SamplingParams(max_new_tokens=4, temperature=temperature, seed=0))


def test_case_83_training_into_a_blown_adapter_stops_with_the_clear_message(tmp_path):
    trainer = _trainer(tmp_path, aqn=dict(enabled=False))
    trainer.train(1)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if p.requires_grad:
                p.fill_(1e20)  # what one step at lr 1e20 leaves
    with pytest.raises(ValueError, match="the policy's logits are non-finite"):
        trainer.train(1)


# ---- the trainer's loss, gradients and checkpoints ------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("nf"), aqn=dict(enabled=False))
    trainer.train(1)
    return trainer


def test_a_non_finite_loss_is_an_error_naming_the_step(trained, monkeypatch):
    from qerl_kit import grpo

    dapo = grpo.LOSSES["dapo"]
    monkeypatch.setitem(grpo.LOSSES, "dapo", grpo.LossSpec(lambda *a, **k: dapo.fn(*a, **k) * float("nan"), "tokens"))
    before = {n: p.detach().clone() for n, p in trained.model.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match=r"step 2: the loss of micro-batch rows 0:4 is nan"):
        trained.train(1)
    assert all(torch.equal(p, before[n]) for n, p in trained.model.named_parameters() if p.requires_grad)
    trained.step = 1  # the failed step is redone by the next test


def test_non_finite_gradients_name_the_parameter_and_stop_when_they_repeat(trained):
    target = next(p for n, p in trained.model.named_parameters() if p.requires_grad)
    name = next(n for n, p in trained.model.named_parameters() if p is target)
    handle = target.register_hook(lambda g: g * float("nan"))
    try:
        with pytest.warns(RuntimeWarning, match=rf"first non-finite gradient: '{name}'; optimizer step skipped"):
            trained.train(2)
        with pytest.raises(ValueError, match=rf"'{name}'; 3 updates in a row had a non-finite gradient"):
            trained.train(1)
    finally:
        handle.remove()
    assert all(torch.isfinite(p).all() for p in trained.model.parameters() if p.requires_grad)


def test_a_non_finite_adapter_is_never_written_to_a_checkpoint(trained):
    p = next(p for p in trained.model.parameters() if p.requires_grad)
    keep = p.detach().clone()
    with torch.no_grad():
        p[0, 0] = float("inf")
    try:
        with pytest.raises(ValueError, match=r"the adapter for '.*checkpoint-\d+': weight .* is not finite .*not written"):
            trained.save()
        assert not list(trained.output_dir.glob("checkpoint-*"))
    finally:
        with torch.no_grad():
            p.copy_(keep)


# ---- divergence ------------------------------------------------------------------------------------

def _rows(rewards, entropies):
    return [{"step": i + 1, "reward": r, "entropy": e} for i, (r, e) in enumerate(zip(rewards, entropies))]


def test_the_divergence_rule_on_case_82s_numbers_and_its_non_cases():
    from qerl_kit import divergence

    rows = _rows([0.469, 0.0, 0.0, 0.0], [0.021, 2.06, 2.3, 2.2])
    msg = divergence.divergence_warning(rows[:2])
    assert msg.startswith("step 2: training is diverging: reward fell from 0.469 to 0 while entropy rose from 0.021 "
                          "to 2.06")
    assert divergence.divergence_warning(rows[:3]) is None  # said once, at the onset
    assert divergence.divergence_warning(_rows([0.5, 0.45], [0.02, 2.0])) is None  # reward holds
    assert divergence.divergence_warning(_rows([0.5, 0.0], [0.02, 0.03])) is None  # entropy steady
    assert divergence.divergence_warning(_rows([0.5, 0.0], [0.01, 0.2])) is None  # a rise too small in nats
    assert divergence.divergence_warning(_rows([0.05, 0.0], [0.02, 2.0])) is None  # nothing to lose


def test_case_82_lr_10_is_refused_and_a_diverging_run_says_so(tmp_path):
    """lr 10 is refused where it enters; lr 1.0, the largest allowed, still diverges on the tiny task
    (reward 0.625 -> 0, entropy 0.016 -> 1.3) and the run says so, once, in its log."""
    from qerl_kit.build import build_policy
    from qerl_kit.config import preset
    from qerl_kit.config_types import ConfigError
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    with pytest.raises(ConfigError, match=r"optim\.lr must be .*; got 10\.0"):
        preset("tiny-cpu", optim=dict(lr=10.0))
    cfg = preset("tiny-cpu", data=dict(eval_size=8, train_size=64), aqn=dict(enabled=False), optim=dict(lr=1.0),
                 rollout=dict(batch_size=16, group_size=4, max_new_tokens=32), loss=dict(micro_batch=16),
                 total_steps=2, save_every=0, output_dir=str(tmp_path / "run"))
    policy, tok, _ = build_policy(cfg.model, seed=0)
    trainer = Trainer(policy, tok, make_task(cfg.data), cfg, progress="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(2)
    said = [str(w.message) for w in caught if "training is diverging" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("step 2: training is diverging")
    log = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "training is diverging" in log
