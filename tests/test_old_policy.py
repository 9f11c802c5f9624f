"""loss.old_logp: the old-policy log-prob pass folded into the first update iteration ("fold") gives
the same steps as the separate pass ("pass"), bit for bit on the CPU, with one forward per
micro-batch fewer; an active dropout falls back to "pass" with a warning."""

import warnings

import pytest
import torch

from qerl_kit.checkpoint import config_changes
from qerl_kit.config import ConfigError, LossConfig, TrainConfig
from qerl_kit.models import build_model
from qerl_kit.old_policy import OldPolicy, active_dropout, resolve_mode
from qerl_kit.trainer import Trainer
from tests.test_rollout import make_tokenizer
from qerl_kit.tasks.task import Task
from tests.test_trainer import DATA, TASK, _config, _prompt, first_char_reward
from tests.tiny_policy import tiny_policy

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _policy(seed=0, dropout=0.0):
    """The tiny quantized policy with a random LoRA B and a sharpened head (tests/tiny_policy.py)."""
    return tiny_policy(seed=seed, dropout=dropout, head_scale=4.0)


# first_char_reward alone: 0/1 rewards, so some groups tie and dynamic sampling draws more rounds
BINARY = Task("binary", DATA, DATA[:2], (first_char_reward,), _prompt)


def _run(tmp_path, mode, steps=2, dropout=0.0, task=TASK, **over):
    """A trainer with loss.old_logp = mode after ``steps`` steps, and each step's OldPolicy."""
    over["loss"] = {**over.get("loss", {}), "old_logp": mode}
    trainer = Trainer(_policy(dropout=dropout), make_tokenizer(), task, _config(tmp_path / mode, **over),
                      progress="none")
    olds, metrics = [], trainer._metrics
    trainer._metrics = lambda prep, update: (olds.append(prep.old), metrics(prep, update))[1]
    torch.manual_seed(0)  # dropout's RNG, when there is one
    trainer.train(steps)
    return trainer, olds


def _timing(key: str) -> bool:  # wall-clock metrics: time/*, rollout/tokens_per_s, *_seconds
    return key.startswith("time/") or key.endswith("_per_s") or key.endswith("seconds")


def _same_steps(a, olds_a, b, olds_b):
    """Bit-equal old log-probs, entropy, IS weights, metrics (but wall times) and adapter weights."""
    for x, y in zip(olds_a, olds_b, strict=True):
        assert torch.equal(x.old_logp, y.old_logp) and torch.equal(x.entropy, y.entropy)
        assert (x.is_weights is None) == (y.is_weights is None)
        assert x.is_weights is None or torch.equal(x.is_weights, y.is_weights)
    for ra, rb in zip(a.history, b.history, strict=True):
        assert set(ra) == set(rb)
        assert {k: v for k, v in ra.items() if not _timing(k)} == {k: v for k, v in rb.items() if not _timing(k)}
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(p, pb[n]) for n, p in pa.items())


@pytest.mark.parametrize("over", [
    {},                                                                    # mu 1, token TIS, AQN on
    {"loss": {"mu": 2}, "aqn": {"enabled": False}},
    {"loss": {"mu": 2, "beta": 0.05, "loss": "grpo"}},                     # the reference pass stays
    {"loss": {"mu": 2, "is_correction": "sequence_mask", "micro_batch": 3}},  # uneven micro-batches
    {"loss": {"is_correction": None, "loss": "dr_grpo"}},
    {"loss": {"mu": 2}, "model": {"gradient_checkpointing": True}},       # the fold's forward recomputed in backward
    {"filters": {"dynamic_sampling": True, "max_sampling_rounds": 3}, "task": BINARY},  # a batch over rounds
    {"filters": {"mask_truncated": True}, "loss": {"mu": 2, "is_correction": "sequence_truncate"},
     "rollout": {"max_new_tokens": 24}},                                   # 7 of 8 rows truncated and masked, sequence IS
], ids=["mu1", "mu2", "mu2-beta", "mu2-seq-is", "no-is", "mu2-ckpt", "dynamic-sampling", "mask-truncated-seq-is"])
def test_fold_gives_the_same_steps_as_the_separate_pass_bit_for_bit(tmp_path, over):
    fold, fold_olds = _run(tmp_path, "fold", **over)
    pas, pass_olds = _run(tmp_path, "pass", **over)
    assert fold._old_logp == "fold" and pas._old_logp == "pass"
    _same_steps(fold, fold_olds, pas, pass_olds)
    first = dict(_policy().named_parameters())
    assert any(not torch.equal(p, first[n]) for n, p in fold.model.named_parameters() if p.requires_grad)
    assert not torch.equal(fold_olds[0].old_logp, fold_olds[1].old_logp)  # the update moved the policy
    beta = over.get("loss", {}).get("beta", 0)
    for row in fold.history:  # nothing runs before the update unless the reference pass does
        assert (row["time/logprob"] > 0) if beta else (row["time/logprob"] == 0.0)
    if over.get("loss", {}).get("is_correction", "token_truncate"):
        assert "sampling/importance_sampling_ratio/mean" in fold.history[0]
        assert fold_olds[0].is_weights.abs().sum() > 0
    if beta:
        assert fold.history[0]["kl"] > 1e-6  # random B: the policy is not the reference
    if over.get("filters", {}).get("dynamic_sampling"):
        assert all(row["sampling/rounds"] > 1 for row in fold.history)  # the batch came from several rounds
    if over.get("filters", {}).get("mask_truncated"):  # some rows masked out of the loss, some kept
        assert all(0 < o.mask.sum() < o.batch.completion_mask.sum() for o in fold_olds)


def _count_forwards(tmp_path, mode, **over):
    """Training-side forwards of the model per step (the rollout's forwards are not counted)."""
    over["loss"] = {**over.get("loss", {}), "old_logp": mode}
    trainer = Trainer(_policy(), make_tokenizer(), TASK, _config(tmp_path / mode, **over), progress="none")
    counts, on = [0], [True]
    trainer.model.register_forward_hook(lambda *_: counts.__setitem__(0, counts[0] + on[0]))
    collect = trainer._collect

    def quiet_collect(step):
        on[0] = False
        try:
            return collect(step)
        finally:
            on[0] = True
    trainer._collect = quiet_collect
    trainer.train(2)
    return counts[0] / 2


@pytest.mark.parametrize("mu, beta", [(1, 0.0), (2, 0.0), (1, 0.05)])
def test_the_fold_removes_one_forward_per_micro_batch(tmp_path, mu, beta):
    over = dict(loss=dict(mu=mu, beta=beta, micro_batch=4))  # batch 8: two micro-batches
    fold, pas = _count_forwards(tmp_path, "fold", **over), _count_forwards(tmp_path, "pass", **over)
    assert pas - fold == 2
    # fold: mu update passes and the reference pass when beta > 0; nothing else (the clip metrics reuse the update's)
    assert fold == 2 * mu + 2 * (beta > 0)


def test_an_active_dropout_falls_back_to_the_pass_once_and_changes_no_number(tmp_path):
    with pytest.warns(UserWarning, match=r"loss\.old_logp='fold'.*lora_dropout.*using loss\.old_logp='pass'"):
        fold, fold_olds = _run(tmp_path, "fold", dropout=0.1, aqn=dict(enabled=False))
    assert fold._old_logp == "pass"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # no second warning, and none for an explicit "pass"
        fold.train(1)
        pas, pass_olds = _run(tmp_path, "pass", dropout=0.1, aqn=dict(enabled=False))
    assert not [w for w in seen if "old_logp" in str(w.message)]
    pas.train(1)
    _same_steps(fold, fold_olds, pas, pass_olds)


def test_active_dropout_names_modules_attention_and_config():
    model = build_model("qwen2-tiny", seed=0)
    assert active_dropout(model) is None and resolve_mode("fold", model) == "fold"
    attn = next(n for n, m in model.named_modules() if hasattr(m, "attention_dropout"))
    model.get_submodule(attn).attention_dropout = 0.1  # what HF's attention applies in train mode
    assert active_dropout(model) == f"{attn}.attention_dropout"
    model.get_submodule(attn).attention_dropout = 0.0
    model.config.hidden_dropout = 0.2
    assert active_dropout(model) == "config.hidden_dropout"
    model.config.hidden_dropout = 0.0
    model.model.layers[0].mlp.drop = torch.nn.Dropout(0.3)
    assert active_dropout(model) == "model.layers.0.mlp.drop"
    with pytest.warns(UserWarning, match="model.layers.0.mlp.drop"):
        assert resolve_mode("fold", model) == "pass"
    assert resolve_mode("pass", model) == "pass"
    with pytest.raises(ValueError, match="loss.old_logp"):
        resolve_mode("folded", model)


def test_the_config_key_is_checked_and_resume_neutral():
    assert LossConfig().old_logp == "fold" and LossConfig(old_logp="pass").old_logp == "pass"
    with pytest.raises(ConfigError, match=r"loss\.old_logp.*'fold', 'pass'.*'eager'"):
        LossConfig(old_logp="eager")
    a, b = TrainConfig().to_dict(), TrainConfig(loss=dict(old_logp="pass")).to_dict()
    assert config_changes(a, b) == {}  # the same numbers either way: a resume may switch


def test_old_policy_fills_rows_and_their_weights_alone():
    """Per-row IS weights: computing them a micro-batch at a time equals the whole batch's."""
    g = torch.Generator().manual_seed(3)
    n, C = 6, 5

    class _Batch:
        logprobs = -torch.rand(n, C, generator=g) * 3

    mask = (torch.rand(n, C, generator=g) > 0.2).float()
    logp, ent = -torch.rand(n, C, generator=g) * 3, torch.rand(n, C, generator=g)
    for mode in ("token_truncate", "sequence_mask"):
        whole, parts = OldPolicy(_Batch, mask, mode, 3.0), OldPolicy(_Batch, mask, mode, 3.0)
        whole.fill(slice(0, n), logp, ent)
        for s in range(0, n, 4):
            parts.fill(slice(s, s + 4), logp[s:s + 4], ent[s:s + 4])
        assert torch.allclose(whole.is_weights, parts.is_weights, rtol=1e-6, atol=0)
        assert whole.is_weights.abs().sum() > 0 and not whole.ready
        stats = parts.finish()
        assert parts.ready and stats["sampling/importance_sampling_ratio/max"] <= 3.0


def test_one_training_forward_gives_logp_with_grad_and_the_eval_passes_values():
    """completion_logprobs in train mode with autograd: log-probs with gradient (the same gradient as
    without the entropy) and the entropy without, both bit-equal to the eval-mode no-grad pass's."""
    from qerl_kit.logprobs import completion_logprobs

    model, g = _policy(), torch.Generator().manual_seed(5)
    V = model.config.vocab_size
    pi, ci = torch.randint(3, V, (4, 5), generator=g), torch.randint(3, V, (4, 7), generator=g)
    pm, cm = torch.ones(4, 5, dtype=torch.long), torch.ones(4, 7, dtype=torch.long)
    pm[0, :2], cm[1, 4:] = 0, 0  # left-padded prompt, right-padded completion
    model.eval()
    with torch.no_grad():
        ref, ref_ent = completion_logprobs(model, pi, pm, ci, cm, 0.7, with_entropy=True)
    model.train()
    grads = []
    for with_entropy in (True, False):
        model.zero_grad(set_to_none=True)
        out = completion_logprobs(model, pi, pm, ci, cm, 0.7, with_entropy=with_entropy)
        logp = out[0] if with_entropy else out
        assert logp.requires_grad and torch.equal(logp.detach(), ref)
        if with_entropy:
            assert not out[1].requires_grad and torch.equal(out[1], ref_ent) and ref_ent[0].gt(0).all()
        logp.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and any(a.abs().sum() > 0 for a in grads[0])


def _random_batch(model, n, P, C, device, seed=7):
    from types import SimpleNamespace

    g, V = torch.Generator().manual_seed(seed), model.config.vocab_size
    pm, cm = torch.ones(n, P, dtype=torch.long), torch.ones(n, C, dtype=torch.long)
    for i in range(n):  # left-padded prompts, right-padded completions of varied lengths
        pm[i, :int(torch.randint(0, P - 1, (), generator=g))] = 0
        cm[i, int(torch.randint(1, C + 1, (), generator=g)):] = 0
    batch = SimpleNamespace(prompt_ids=torch.randint(3, V, (n, P), generator=g) * pm, prompt_mask=pm,
                            completion_ids=torch.randint(3, V, (n, C), generator=g) * cm, completion_mask=cm,
                            logprobs=-torch.rand(n, C, generator=g).mul(4) * cm)
    return SimpleNamespace(**{k: v.to(device) for k, v in vars(batch).items()})


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_folded_forward_fills_what_the_pass_fills(device):
    """OldPolicy.forward (train mode, autograd on, micro-batch by micro-batch: the fold) against
    OldPolicy.run_pass (eval mode, no grad) on one batch. CPU: bit-equal. CUDA (bf16, NVFP4 base):
    the same kernels are expected, so the same values; asserted to bf16 logit rounding, and any
    difference is reported (the fold's own forward is the one the update's ratio compares with)."""
    model = tiny_policy(device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    batch = _random_batch(model, 10, 6, 9, device)
    mask = batch.completion_mask.float()
    passed = OldPolicy(batch, mask, "token_truncate", 3.0)
    stats = passed.run_pass(model, 0.8, 4)
    folded = OldPolicy(batch, mask, "token_truncate", 3.0)
    model.train()
    for s in range(0, 10, 4):
        logp = folded.forward(model, slice(s, s + 4), 0.8)
        assert logp.requires_grad and torch.equal(logp.detach(), folded.old_logp[s:s + 4])
    folded_stats = folded.finish()
    assert passed.ready and folded.ready and mask.sum() > 0 and set(folded_stats) == set(stats)
    if device == "cpu":
        assert folded_stats == stats
        for name in ("old_logp", "entropy", "is_weights"):
            assert torch.equal(getattr(folded, name), getattr(passed, name)), name
        return
    diff = (folded.old_logp - passed.old_logp).abs()
    if not torch.equal(folded.old_logp, passed.old_logp):
        warnings.warn(f"CUDA: fold vs pass old_logp differ: max {diff.max().item():.3g}, "
                      f"mean {diff[mask > 0].mean().item():.3g}", UserWarning)
    assert diff.max() < 0.1 and diff[mask > 0].mean() < 1e-2
    torch.testing.assert_close(folded.entropy, passed.entropy, atol=0.1, rtol=0.02)
    torch.testing.assert_close(folded.is_weights, passed.is_weights, atol=0.1, rtol=0.1)
    for key, value in stats.items():  # the statistics of weights that agree to that tolerance
        assert folded_stats[key] == pytest.approx(value, rel=0.1, abs=0.1), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_step_folds_with_the_static_engine(tmp_path):
    """One Trainer step on CUDA (bf16 tiny model, NVFP4 base, the static engine) with fold and with
    pass: the same rollouts give close old log-probs, loss and grad norm, and the fold runs no
    separate pass (time/logprob 0.0)."""
    runs = {}
    for mode in ("fold", "pass"):
        model = tiny_policy(device="cuda", dtype=torch.bfloat16)
        cfg = _config(tmp_path / mode, loss=dict(old_logp=mode, mu=2), aqn=dict(enabled=False))
        trainer = Trainer(model, make_tokenizer(), TASK, cfg, progress="none")
        olds, metrics = [], trainer._metrics
        trainer._metrics = lambda prep, update: (olds.append((prep.batch, prep.old)), metrics(prep, update))[1]
        trainer.train(1)
        runs[mode] = trainer, olds[0]
    (fold, (fb, fo)), (pas, (pb, po)) = runs["fold"], runs["pass"]
    if not torch.equal(fb.completion_ids, pb.completion_ids):
        pytest.skip("the two runs sampled different rollouts (rollout reproducibility, not the fold)")
    assert fold.history[0]["time/logprob"] == 0.0 and pas.history[0]["time/logprob"] > 0
    mask = fb.completion_mask.bool()
    assert (fo.old_logp - po.old_logp).abs()[mask].mean() < 1e-2
    for key in ("loss", "grad_norm", "entropy"):
        assert fold.history[0][key] == pytest.approx(pas.history[0][key], rel=0.05, abs=1e-3), key


def test_a_run_saved_under_pass_resumes_under_fold_exactly(tmp_path):
    """loss.old_logp is resume-neutral: checkpoint-2 of a "pass" run, resumed with "fold" (no
    allow_config_change), continues exactly as the uninterrupted "fold" run."""
    full, _ = _run(tmp_path / "full", "fold", steps=4, save_every=2, loss=dict(mu=2))
    _run(tmp_path / "killed", "pass", steps=3, save_every=2, loss=dict(mu=2))
    resumed = Trainer(_policy(), make_tokenizer(), TASK,
                      _config(tmp_path / "killed" / "pass", save_every=2, loss=dict(mu=2, old_logp="fold")),
                      progress="none")
    assert resumed.output_dir == tmp_path / "killed" / "pass" / "run"
    assert resumed.resume(resumed.output_dir / "checkpoint-2") == 2
    resumed.train(2)
    for a, b in zip(resumed.history, full.history, strict=True):
        assert {k: v for k, v in a.items() if not _timing(k)} == {k: v for k, v in b.items() if not _timing(k)}


def test_micro_batches_sorted_by_length_give_the_batch_orders_steps_up_to_rounding(tmp_path):
    # loss.micro_batch_order: rows of similar lengths share a micro-batch (each trimmed to its own width);
    # every row is in one micro-batch and the normalizers are global, so the steps agree to float rounding
    runs = {}
    for order in ("length", "packed", "batch"):
        trainer = Trainer(_policy(), make_tokenizer(), TASK, _config(tmp_path / order, loss={
            "mu": 2, "micro_batch": 3, "micro_batch_order": order, "is_correction": "sequence_truncate"},
            rollout={"max_new_tokens": 24}), progress="none")  # some rows stop before the cap
        seen, metrics = [], trainer._metrics
        trainer._metrics = lambda prep, update, seen=seen, metrics=metrics: (seen.append(prep), metrics(prep, update))[1]
        trainer.train(2)
        runs[order] = trainer, seen
    by_batch, batch_preps = runs["batch"]
    assert all(isinstance(g, slice) for p in batch_preps for g in p.groups)
    for order in ("length", "packed"):
        trainer, preps = runs[order]
        sorted_groups = [g for p in preps for g in p.groups if not isinstance(g, slice)]
        assert sorted_groups  # the completions' lengths differ: some micro-batch was regrouped
        for prep in preps:  # every row in exactly one micro-batch, each group's rows ascending
            rows = torch.cat([torch.arange(prep.mask.shape[0])[g] for g in prep.groups])
            assert sorted(rows.tolist()) == list(range(prep.mask.shape[0]))
        for a, b in zip(preps, batch_preps, strict=True):
            torch.testing.assert_close(a.old.old_logp, b.old.old_logp, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a.old.is_weights, b.old.is_weights, rtol=1e-5, atol=1e-6)
        for ra, rb in zip(trainer.history, by_batch.history, strict=True):
            for key in ("loss", "grad_norm", "entropy", "reward", "kl"):
                if key in ra:
                    assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (order, key)
        pb = dict(by_batch.model.named_parameters())
        for name, p in trainer.model.named_parameters():
            torch.testing.assert_close(p, pb[name], rtol=1e-4, atol=1e-6)


def test_a_steps_read_backs_do_not_grow_with_its_micro_batches(tmp_path):
    # micro_batch_plan reads every row's lengths back once; the forwards (the old-policy pass, the
    # reference pass, mu x the update) get their padding bounds from it, none per micro-batch
    import re

    from bench.common import profiled

    counts = {}
    for micro in (2, 8):
        trainer = Trainer(_policy(), make_tokenizer(), TASK, _config(tmp_path / str(micro), loss={
            "mu": 2, "micro_batch": micro, "old_logp": "pass", "beta": 0.05}, rollout={"max_new_tokens": 24}),
            progress="none")
        _, text, _ = profiled(trainer.train_step, 5)
        counts[micro] = sum(int(n) for n in re.findall(r"(\d+) x aten::nonzero", text.split("\n\n")[0]))
    assert counts[2] == counts[8] > 0  # 4 micro-batches or 1: the same nonzero calls (none from padding_bounds)


def test_micro_batch_order_is_checked_where_the_config_enters():
    with pytest.raises(ConfigError, match="loss.micro_batch_order"):
        LossConfig(micro_batch_order="longest")
