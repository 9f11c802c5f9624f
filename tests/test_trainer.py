"""The GRPO loop end to end on CPU: finite metrics, chunks, resume equality, loss variants."""

import json
import math

import pytest
import torch

from qerl_kit.config import TrainConfig, from_dict
from qerl_kit.lora import attach_lora
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.sampling_filters import overlong_penalty
from qerl_kit.tasks import Task
from qerl_kit.trainer import Trainer
from tests.test_rollout import make_tokenizer

DATA = [{"prompt": p, "answer": a} for p, a in
        [("ab", "a"), ("cd", "c"), ("ef", "e"), ("gh", "g"), ("ij", "i"), ("kl", "k")]]


def first_char_reward(prompts, completions, answer, **_):
    """1 when the completion starts with the answer's letter (learnable by a tiny random model)."""
    return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer)]


def ascii_reward(prompts, completions, **_):
    """Share of plain ASCII characters: varies within every group, so advantages are non-zero."""
    return [sum(ch.isascii() for ch in c) / max(len(c), 1) for c in completions]


def _prompt(tokenizer, row):
    return row["prompt"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _policy(seed=0):
    model = build_model("qwen2-tiny", seed=seed)
    quantize_model(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return attach_lora(model, r=4, seed=seed)


def _config(tmp_path, **over):
    base = dict(rollout=dict(batch_size=8, group_size=4, max_new_tokens=6, temperature=1.0),
                loss=dict(loss="dapo", micro_batch=4), optim=dict(lr=5e-3),
                aqn=dict(enabled=True, stages=3), total_steps=6, save_every=0, output_dir=str(tmp_path / "run"))
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(base)


TASK = Task("letters", DATA, DATA[:2], (first_char_reward, ascii_reward), _prompt)


def _trainer(tmp_path, seed=0, task=TASK, **over):
    return Trainer(_policy(seed), make_tokenizer(), task, _config(tmp_path, **over), progress="none")


def test_steps_run_end_to_end_with_finite_trl_named_metrics(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train(2)
    trainer.train(1)  # chunks continue where the last one stopped
    assert trainer.step == 3 and [r["step"] for r in trainer.history] == [1, 2, 3]
    row = trainer.history[-1]
    for key in ("reward", "reward_std", "accuracy", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio",
                "frac_reward_zero_std", "aqn/sigma", "rollout/temperature", "rollout/tokens_per_s", "time/rollout",
                "time/logprob", "time/update", "rewards/first_char_reward/mean", "rewards/ascii_reward/mean", "loss",
                "grad_norm", "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"):
        assert key in row and math.isfinite(row[key]), key
    assert trainer.history[0]["aqn/sigma"] == 0.0 and trainer.history[2]["aqn/sigma"] > 0  # stage 0, then 1
    assert trainer.history[2]["aqn/norms"] == 4
    from qerl_kit.widgets.dashboard import check_metrics  # plots.TRAINER_METRICS lists every metric a step logs

    assert check_metrics([k for k in row if k != "warning"]) == tuple(k for k in row if k != "warning")
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert list(trainer.metrics.columns).count("reward") == 1 and len(trainer.metrics) == 3


def test_only_the_adapter_changes_and_the_base_stays_packed(tmp_path):
    trainer = _trainer(tmp_path)
    base = {n: b.clone() for n, b in trainer.model.named_buffers()}
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train(2)
    assert all(torch.equal(b, base[n]) for n, b in trainer.model.named_buffers())
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert changed  # lora_B starts at zero and moves


def test_resume_after_a_kill_gives_the_same_next_steps(tmp_path):
    full = _trainer(tmp_path / "a", save_every=2)
    full.train(4)
    killed = _trainer(tmp_path / "b", save_every=2)
    killed.train(3)  # "killed" after step 3: checkpoint-2 is the last one
    assert (tmp_path / "b" / "run" / "checkpoint-2").is_dir()
    resumed = _trainer(tmp_path / "b", save_every=2)
    assert resumed.resume() == 2
    assert len(resumed.history) == 2  # nothing before the checkpoint is lost
    resumed.train(2)
    for key in ("reward", "entropy", "loss", "grad_norm", "completions/mean_length"):
        assert [r[key] for r in resumed.history] == pytest.approx([r[key] for r in full.history], rel=1e-5, abs=1e-7), key
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
def test_loss_variants_kl_and_mu(tmp_path, loss):
    trainer = _trainer(tmp_path, loss=dict(loss=loss, beta=0.05, mu=2), aqn=dict(enabled=False))
    trainer.train(2)
    first, second = trainer.history
    # LoRA's B starts at zero: before the first update the policy is the reference, so its KL is 0;
    # after an update (mu = 2 optimizer steps) the adapter has moved and the KL is positive
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and second["kl"] > 1e-6 and "aqn/sigma" not in first


def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    plain = _trainer(tmp_path / "a", aqn=dict(enabled=False))
    ckpt = _trainer(tmp_path / "b", aqn=dict(enabled=False), model=dict(gradient_checkpointing=True))
    plain.train(1)
    ckpt.train(1)
    assert ckpt.history[0]["grad_norm"] == pytest.approx(plain.history[0]["grad_norm"], rel=1e-4)


def _spy_prepare(trainer):
    """Record the (batch, rewards) the update phase receives."""
    seen, prepare = [], trainer._prepare
    trainer._prepare = lambda batch, rewards, metrics, *plan: (seen.append((batch, rewards.clone())),
                                                               prepare(batch, rewards, metrics, *plan))[1]
    return seen


def test_dynamic_sampling_keeps_groups_with_spread_and_fills_at_the_round_limit(tmp_path):
    calls = []

    def scripted(prompts, completions, **_):  # round 1: no spread; round 2: group 0 only; round 3: none
        calls.append(list(prompts))
        return [0.0, 1.0, 0.0, 1.0] + [0.0] * 4 if len(calls) == 2 else [0.0] * 8

    trainer = _trainer(tmp_path, task=Task("scripted", DATA, [], (scripted,), _prompt), aqn=dict(enabled=False),
                       filters=dict(dynamic_sampling=True, max_sampling_rounds=3))
    seen = _spy_prepare(trainer)
    trainer.train(1)
    row, (batch, rewards) = trainer.history[0], seen[0]
    assert row["sampling/rounds"] == 3 and row["sampling/filled_groups"] == 1 and len(calls) == 3
    # the batch: round 2's group 0 (the one with spread), then round 3's first group to fill the target
    assert batch.prompts == calls[1][:4] + calls[2][:4] and rewards.tolist() == [0.0, 1.0, 0.0, 1.0] + [0.0] * 4
    assert row["frac_reward_zero_std"] == 1.0  # metrics describe the first round, as TRL's do


def test_overlong_shaping_penalizes_long_completions(tmp_path):
    trainer = _trainer(tmp_path, task=Task("flat", DATA, [], (lambda completions, **_: [1.0] * len(completions),),
                                           _prompt), aqn=dict(enabled=False),
                       filters=dict(overlong_buffer=3, overlong_penalty=0.5))
    seen = _spy_prepare(trainer)
    trainer.train(1)
    batch, rewards = seen[0]
    lengths = batch.completion_lengths
    expected = 1.0 + overlong_penalty(lengths, 6, 3, 0.5)
    assert torch.allclose(rewards, expected) and (lengths > 3).any() and (rewards < 1.0).any()


def test_set_lr_between_chunks(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train(1)
    trainer.set_lr(1e-4)
    trainer.train(1)
    assert trainer.history[-1]["lr"] == pytest.approx(1e-4)


def test_rollout_temperature_is_logged_per_step(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train(1)
    trainer.config = trainer.config.replace(rollout={"temperature": 0.7})  # what a dashboard does between chunks
    trainer.train(1)
    assert [r["rollout/temperature"] for r in trainer.history] == [1.0, 0.7]


def test_constructor_errors(tmp_path):
    plain = build_model("qwen2-tiny")
    for p in plain.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        Trainer(plain, make_tokenizer(), TASK, TrainConfig())
    with pytest.raises(ValueError, match="no training rows"):
        Trainer(_policy(), make_tokenizer(), TASK.with_rows(train=[]), TrainConfig())
    with pytest.raises(TypeError, match="takes a qerl_kit.tasks.Task"):
        Trainer(_policy(), make_tokenizer(), DATA, TrainConfig())


def test_a_non_finite_gradient_skips_the_update_and_training_goes_on(tmp_path):
    # seen on a GPU: one NaN gradient (bf16 NF4-LoRA at a high lr) made the adapter NaN for good
    trainer = _trainer(tmp_path, aqn=dict(enabled=False))
    trainer.train(1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    moments = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    # a finite loss whose gradient is NaN (a non-finite loss is an error: tests/adversarial/test_nonfinite.py)
    handle = next(p for p in trainer.model.parameters() if p.requires_grad).register_hook(lambda g: g * float("nan"))
    with pytest.warns(RuntimeWarning, match="optimizer step skipped"):
        trainer.train(1)
    row = trainer.history[-1]
    assert row["update/skipped"] == 1 and math.isnan(row["grad_norm"])
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(torch.equal(v, moments[k]) for k, v in trainer.optimizer.state_dict()["state"][0].items())
    handle.remove()
    trainer.train(1)
    assert trainer.history[-1]["update/skipped"] == 0 and math.isfinite(trainer.history[-1]["grad_norm"])
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("mu", [1, 2, 3])
def test_clip_metrics_count_the_tokens_the_loss_clipped_over_all_iterations(tmp_path, mu):
    # A large lr moves the policy far in one optimizer step, so iterations 2..mu clip many tokens; the
    # first iteration runs at the old policy (ratio 1: nothing clipped), so over all mu iterations at
    # most (mu - 1) / mu of the tokens were clipped, and with mu = 1 none.
    trainer = _trainer(tmp_path, loss=dict(mu=mu, eps_low=0.01, eps_high=0.01), optim=dict(lr=0.5),
                       aqn=dict(enabled=False))
    trainer.train(2)
    region = [row["clip_ratio/region_mean"] for row in trainer.history]
    if mu == 1:
        assert region == [0.0, 0.0]
    else:
        assert all(0.0 < r <= (mu - 1) / mu + 1e-9 for r in region), region


def test_phase_times_wait_for_the_device_at_each_boundary(tmp_path, monkeypatch):
    """time/logprob and time/update are read after step_phases.synchronize at the three phase
    boundaries of a step (before the log-prob phase, between it and the update, after the update);
    on the CPU the helper waits for nothing, on CUDA it is torch.cuda.synchronize."""
    from qerl_kit import step_phases

    trainer, calls, order = _trainer(tmp_path, loss=dict(beta=0.05)), [], []
    real_sync, update = step_phases.synchronize, trainer._update
    monkeypatch.setattr(step_phases, "synchronize", lambda device: (calls.append(device), real_sync(device))[1])
    trainer._update = lambda prep, metrics: (order.append(len(calls)), update(prep, metrics))[1]
    trainer.train(2)
    assert calls == [trainer._device] * 6 and order == [2, 5]  # two before each update, one after
    row = trainer.history[-1]
    assert row["time/logprob"] > 0 and row["time/update"] > 0  # beta > 0: a reference pass runs first
    cuda = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: cuda.append(device))
    real_sync(torch.device("cpu"))
    real_sync(torch.device("cuda", 0))
    assert cuda == [torch.device("cuda", 0)]


def test_on_cuda_each_step_logs_its_own_memory_by_phase(tmp_path, monkeypatch):
    """memory/rollout_peak_gib and memory/after_rollout_gib (read when the rollout ends) and
    memory/peak_gib (the step's own: CUDA's peak counter restarts with each step); a CPU step logs
    none of them. Fake CUDA counters: the rollout peaks at 2 GiB and leaves 1, the update peaks at 5."""
    import qerl_kit.trainer as trainer_mod

    trainer = _trainer(tmp_path)
    trainer.train(1)
    assert [k for k in trainer.history[-1] if k.startswith("memory/")] == ["memory/dense_cache_gib"]
    gib, fake = 1 << 30, {"now": 0, "peak": 0, "resets": 0}

    def reset(device=None):
        fake.update(peak=fake["now"], resets=fake["resets"] + 1)

    def holding(method, now, peak):
        def run(*args, **kwargs):
            out = method(*args, **kwargs)
            fake.update(now=now * gib, peak=max(fake["peak"], peak * gib))
            return out
        return run
    monkeypatch.setattr(trainer_mod, "_cuda_counters", lambda device: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: fake["now"])
    monkeypatch.setattr(trainer, "_collect", holding(trainer._collect, 1, 2))
    monkeypatch.setattr(trainer, "_update", holding(trainer._update, 1, 5))
    trainer.train(2)
    for row in trainer.history[-2:]:  # the second step's rollout peak is its own, not the first update's 5
        assert (row["memory/rollout_peak_gib"], row["memory/after_rollout_gib"], row["memory/peak_gib"]) == (2, 1, 5)
    assert fake["resets"] == 2
