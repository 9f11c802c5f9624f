"""rollout.keep_cache / rollout.max_rows / rollout.share_weights: the config keys, the plan's rows,
the auto choice (qerl_kit.engine_memory) and what the StaticEngine and the Trainer do with them."""

import types
import warnings

import pytest
import torch

from qerl_kit import engine_memory
from qerl_kit.checkpoint import config_changes
from qerl_kit.config import ConfigError, RolloutConfig, preset
from qerl_kit.memory_plan import plan_memory

GiB = 2**30
PAPER = dict(batch_size=128, group_size=8, max_new_tokens=4096)  # the paper's GSM8K rollout


@pytest.fixture(scope="module")
def tiny():
    from qerl_kit.lora import attach_lora
    from qerl_kit.tiny import load_tiny

    model, tok = load_tiny(quantize="nvfp4")
    return attach_lora(model, r=4, seed=0), tok


def _part(plan, prefix):
    (value,) = [v for k, v in plan.parts.items() if k.startswith(prefix)]
    return value


# ---- the config keys ----------------------------------------------------------------------------------
def test_the_keys_default_to_auto_and_are_checked_where_they_enter():
    r = RolloutConfig()
    assert r.keep_cache is None and r.max_rows is None and r.share_weights is None
    assert RolloutConfig(keep_cache=False, max_rows=16, group_size=8).max_rows == 16
    with pytest.raises(ConfigError, match="rollout.max_rows") as err:
        RolloutConfig(max_rows=12, group_size=8)  # would split a group
    assert "multiple of rollout.group_size = 8" in str(err.value)
    with pytest.raises(ConfigError, match="rollout.max_rows"):
        RolloutConfig(max_rows=0)
    for key, value in (("keep_cache", False), ("max_rows", 8), ("share_weights", True)):
        with pytest.raises(ConfigError, match=f"rollout.{key}") as err:  # another engine never reads it
            RolloutConfig(engine="hf", **{key: value})
        assert "static engine" in str(err.value)
    with pytest.raises(ConfigError, match="rollout.keep_cache"):
        RolloutConfig(keep_cache="sometimes")
    with pytest.raises(ConfigError, match="rollout.share_weights"):
        RolloutConfig(share_weights="sometimes")


def test_keep_cache_and_share_weights_are_resume_neutral_and_max_rows_is_not():
    """Freeing the cache and sharing the weights change no rollout (tests below and
    tests/test_shared_weights.py); decoding in turns draws other samples."""
    a = preset("tiny-cpu").to_dict()
    b = preset("tiny-cpu", rollout=dict(engine="static", keep_cache=False, share_weights=True)).to_dict()
    c = preset("tiny-cpu", rollout=dict(engine="static", max_rows=8)).to_dict()
    assert set(config_changes(a, b)) == {"rollout.engine"}
    assert set(config_changes(a, c)) == {"rollout.engine", "rollout.max_rows"}


# ---- the plan's rows --------------------------------------------------------------------------------------
def test_the_plan_decodes_max_rows_at_a_time():
    full = plan_memory("Qwen2.5-7B", rollout_batch=128, group_size=8, max_new_tokens=1024, prompt_len=200)
    half = plan_memory("Qwen2.5-7B", rollout_batch=128, group_size=8, max_new_tokens=1024, prompt_len=200,
                       max_rows=64)
    odd = plan_memory("Qwen2.5-7B", rollout_batch=128, group_size=8, max_new_tokens=1024, prompt_len=200,
                      max_rows=70)  # the engine takes whole groups: 8 prompts x 8
    assert _part(half, "rollout: KV cache") * 2 == _part(full, "rollout: KV cache") == 2 * _part(odd, "rollout: KV cache")
    assert half.training == full.training and half.peak < full.peak  # the update's micro-batches are the same
    big = plan_memory("Qwen2.5-7B", rollout_batch=128, group_size=8, max_rows=4096)
    assert big.parts == plan_memory("Qwen2.5-7B", rollout_batch=128, group_size=8).parts
    hf = plan_memory("Qwen2.5-7B", rollout_batch=128, engine="hf", max_rows=8)  # generate has no max_rows
    assert hf.parts == plan_memory("Qwen2.5-7B", rollout_batch=128, engine="hf").parts
    with pytest.raises(ConfigError, match="max_rows"):
        plan_memory("Qwen2.5-7B", max_rows=0)


def test_the_plans_kv_cache_is_what_the_engine_allocates_with_max_rows(tiny):
    from qerl_kit.rollout import SamplingParams, StaticEngine

    model, tok = tiny
    engine = StaticEngine(model, cuda_graphs=False, max_rows=8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 30, 17, 5, 21, 12)]
    engine.generate_ids(prompts, 4, SamplingParams(max_new_tokens=6, temperature=1.0, seed=2), ignore_eos=True)
    plan = plan_memory(model.config, lora_r=4, rollout_batch=24, group_size=4, prompt_len=30, max_new_tokens=6,
                       micro_batch=4, kv_bytes=4, max_rows=8)  # the CPU model is float32
    assert _part(plan, "rollout: KV cache") == engine._state[1].cache.nbytes


# ---- the auto choice ----------------------------------------------------------------------------------------
def _policy(name="Qwen2.5-32B"):
    return types.SimpleNamespace(config=name)  # model_shape reads a preset name as it reads a config


def _choose(gpu_gib, warn=False, model="Qwen2.5-32B", **rollout):
    cfg = preset("tiny-cpu", model=dict(format="nvfp4", lora_r=32, gradient_checkpointing=True), loss=dict(micro_batch=4),
                 rollout={**PAPER, **rollout})
    return engine_memory.choose(cfg, _policy(model), None, None, gpu_bytes=int(gpu_gib * GiB), prompt_len=200,
                                warn=warn), cfg


def _peak(cfg, rows, keep, model="Qwen2.5-32B", share=False):
    from qerl_kit.kernels.nvfp4_humming import humming_status

    # the choice counts humming's repacked weights where humming runs (a CUDA machine that has it)
    return plan_memory(model, fmt="nvfp4", lora_r=32, optimizer=cfg.optim.optimizer,
                       rollout_batch=128, group_size=8, prompt_len=200, max_new_tokens=4096, micro_batch=4,
                       gradient_checkpointing=cfg.model.gradient_checkpointing, engine="static",
                       humming=humming_status()[0],
                       keep_cache=keep, max_rows=rows, share_weights=share).peak


def test_the_whole_batch_with_the_cache_kept_wherever_it_fits():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default choice is silent
        choice, cfg = _choose(10_000, warn=True)
    assert (choice.keep_cache, choice.max_rows, choice.share_weights) == (True, None, False) and choice.is_default
    assert choice.planned_bytes == _peak(cfg, None, True) and "planned peak" in choice.reason
    assert choice.options == {"keep_cache": True, "max_rows": None, "share_weights": False}


def test_on_an_h200_the_32b_paper_batch_takes_the_most_rows_that_fit():
    """32B NVFP4 at 128 x 4096 does not fit 140 GiB whole; the choice is the largest number of rows
    whose plan fits, the cache kept if it still fits, and no candidate with more rows fits. The
    weights are shared there: without the engine's copy (10.7 GiB) more rows fit."""
    gpu = 140
    choice, cfg = _choose(gpu)
    assert choice.max_rows is not None and choice.max_rows % 8 == 0 and choice.max_rows < 128
    assert choice.share_weights
    assert choice.planned_bytes == _peak(cfg, choice.max_rows, choice.keep_cache, share=True) <= gpu * GiB
    for rows in range(choice.max_rows + 8, 129, 8):
        assert _peak(cfg, rows, False, share=True) > gpu * GiB, rows
    assert _peak(cfg, choice.max_rows, choice.keep_cache) > gpu * GiB  # with the copy these rows do not fit
    if not choice.keep_cache:
        assert _peak(cfg, choice.max_rows, True, share=True) > gpu * GiB
    with pytest.warns(UserWarning, match=rf"a step's 128 completions are decoded {choice.max_rows} at a time") as rec:
        _choose(gpu, warn=True)
    assert "rollout.keep_cache / rollout.max_rows / rollout.share_weights" in str(rec[0].message)
    assert "stored in the engine's fused buffers" in str(rec[0].message)


def test_freeing_the_cache_comes_before_fewer_rows():
    """A GPU between the plan with the cache freed and the plan with it kept: the whole batch, freed."""
    cfg = _choose(10_000)[1]
    kept, freed = _peak(cfg, None, True, "Qwen2.5-7B"), _peak(cfg, None, False, "Qwen2.5-7B")
    assert freed < kept
    shared = _peak(cfg, None, True, "Qwen2.5-7B", share=True)
    assert shared < kept
    choice, _ = _choose((max(freed, shared) + kept) / 2 / GiB, model="Qwen2.5-7B", share_weights=False)
    assert (choice.keep_cache, choice.max_rows, choice.share_weights) == (False, None, False)


def test_sharing_the_weights_comes_before_freeing_the_cache():
    """Sharing costs no speed; freeing the cache costs a graph capture per step. A GPU between the
    plan with the cache kept and shared weights and the plan with the cache kept and the copy: shared."""
    cfg = _choose(10_000)[1]
    kept, shared = _peak(cfg, None, True, "Qwen2.5-7B"), _peak(cfg, None, True, "Qwen2.5-7B", share=True)
    plan = plan_memory("Qwen2.5-7B", lora_r=32, share_weights=True)
    assert not any(k.startswith("engine: fused") for k in plan.parts)
    assert any(k.startswith("engine: fused") for k in plan_memory("Qwen2.5-7B", lora_r=32).parts)
    choice, _ = _choose((shared + kept) / 2 / GiB, model="Qwen2.5-7B")
    assert (choice.keep_cache, choice.max_rows, choice.share_weights) == (True, None, True)
    assert not choice.is_default and "share_weights=True" in choice.reason


def test_when_nothing_fits_the_smallest_plan_is_taken_and_named():
    choice, cfg = _choose(8)
    smallest = min(_peak(cfg, rows, keep, share=share) for rows in range(8, 129, 8) for keep in (True, False)
                   for share in (True, False))
    assert choice.planned_bytes == smallest and "no setting fits" in choice.reason
    with pytest.warns(UserWarning, match="no setting fits"):
        _choose(8, warn=True)


def test_a_configured_setting_is_kept_and_the_other_is_planned_around_it():
    choice, cfg = _choose(140, keep_cache=True, share_weights=False)
    assert choice.keep_cache is True and choice.max_rows < 128 and not choice.share_weights
    assert _peak(cfg, choice.max_rows, True) <= 140 * GiB < _peak(cfg, choice.max_rows + 8, True)
    choice, _ = _choose(140, max_rows=32)
    assert choice.max_rows == 32
    every, _ = _choose(1, keep_cache=False, max_rows=16, share_weights=True)
    assert (every.keep_cache, every.max_rows, every.share_weights, every.planned_bytes) == (False, 16, True, None)
    two, _ = _choose(10_000, keep_cache=False, max_rows=16)  # share_weights planned: not needed here
    assert (two.keep_cache, two.max_rows, two.share_weights) == (False, 16, False) and two.planned_bytes


def test_a_plan_without_a_model_takes_its_shape():
    cfg = _choose(140)[1]
    by_shape = engine_memory.choose(cfg, shape="Qwen2.5-32B", gpu_bytes=140 * GiB, prompt_len=200, warn=False)
    assert by_shape == _choose(140)[0]
    with pytest.raises(ValueError, match="shape=, gpu_bytes= and prompt_len="):
        engine_memory.choose(cfg, shape="Qwen2.5-32B", prompt_len=200)


def test_a_peft_policy_is_planned_from_its_config_and_its_tasks_longest_prompt(tiny):
    """The Trainer's path on a GPU, with the GPU's size given: the shape from the peft model's config,
    the prompt length from the task as the rollouts render it."""
    from qerl_kit.memory_plan import plan_memory as plan
    from qerl_kit.tasks import make_task

    model, tok = tiny
    cfg = preset("tiny-cpu", rollout=dict(engine="static", batch_size=16, group_size=4, max_new_tokens=32),
                 loss=dict(micro_batch=4))
    task = make_task(cfg.data)
    longest = task.longest_prompt(tok)
    sampled = [*task.train[:2000], *task.eval[:2000]]  # the first rows of each split, as vllm_options reads them
    assert longest == max(len(tok(task.prompt(tok, row), add_special_tokens=False)["input_ids"]) for row in sampled)
    choice = engine_memory.choose(cfg, model, tok, task, gpu_bytes=80 * GiB, warn=False)
    want = plan(model.config, fmt="nvfp4", lora_r=cfg.model.lora_r, optimizer=cfg.optim.optimizer, rollout_batch=16,
                group_size=4, prompt_len=longest, max_new_tokens=32, micro_batch=4, gradient_checkpointing=False,
                engine="static", humming=False)
    assert choice.is_default and choice.planned_bytes == want.peak


def test_each_data_parallel_rank_plans_its_share_of_the_batch():
    cfg = _choose(140)[1]
    two = engine_memory.choose(cfg, shape="Qwen2.5-32B", gpu_bytes=140 * GiB, prompt_len=200, world=2, warn=False)
    half, _ = _choose(140, batch_size=64)  # one rank's 64 completions, planned as a run of 64
    assert (two.keep_cache, two.max_rows, two.planned_bytes) == (half.keep_cache, half.max_rows, half.planned_bytes)
    assert two.max_rows is None or two.max_rows < 64
    with pytest.warns(UserWarning, match="each rank's 64 completions"):
        engine_memory.choose(cfg, shape="Qwen2.5-32B", gpu_bytes=80 * GiB, prompt_len=200, world=2)


def test_a_run_the_planner_refuses_keeps_the_defaults(monkeypatch):
    from qerl_kit import memory_plan

    def refuse(*a, **k):
        raise memory_plan.ConfigError("fmt 'mine' has no bits per weight", "fmt", "mine", "a known format")

    monkeypatch.setattr(memory_plan, "plan_memory", refuse)
    choice, _ = _choose(1)
    assert choice.is_default and choice.planned_bytes is None and "no memory plan for this run" in choice.reason


def test_many_groups_are_planned_on_a_bounded_grid():
    counts = engine_memory._group_counts(2**17)
    assert len(counts) <= engine_memory.CANDIDATES and counts[0] == 2**17 and counts[-1] == 1
    assert counts == sorted(set(counts), reverse=True)
    assert engine_memory._group_counts(5) == [5, 4, 3, 2, 1]


def test_a_model_the_planner_cannot_read_keeps_the_defaults():
    cfg = preset("tiny-cpu", rollout=dict(engine="static"))
    choice = engine_memory.choose(cfg, types.SimpleNamespace(config={"hidden_size": 8}), None, None,
                                  gpu_bytes=GiB, prompt_len=10)
    assert choice.is_default and choice.planned_bytes is None and "no memory plan" in choice.reason


# ---- the engine and the trainer ------------------------------------------------------------------------
def test_freeing_the_cache_changes_no_rollout(tiny):
    from qerl_kit.rollout import SamplingParams, StaticEngine

    model, tok = tiny
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    outs = {}
    for keep in (True, False):
        engine = StaticEngine(model, tok, keep_cache=keep)
        outs[keep] = [engine.generate_ids(prompts, 2, SamplingParams(max_new_tokens=8, temperature=1.0, seed=s))
                      for s in (1, 2, 1)]
        assert (engine._state is None) is (not keep)
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(outs[True][0].completion_ids, outs[True][2].completion_ids)  # a kept state is reset


def test_the_trainer_builds_the_static_engine_with_the_run_settings(tiny, tmp_path):
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    model, tok = tiny
    cfg = preset("tiny-cpu", output_dir=str(tmp_path), save_every=0,
                 rollout=dict(engine="static", batch_size=8, group_size=4, max_new_tokens=8, keep_cache=False,
                              max_rows=4, share_weights=True))
    trainer = Trainer(model, tok, make_task(cfg.data), cfg, progress="none")
    assert (trainer.engine.keep_cache, trainer.engine.max_rows, trainer.engine.shares_weights) == (False, 4, True)
    assert trainer.engine_memory.reason.endswith("as configured")
    row = trainer.train_step()
    assert row["num_tokens"] > 0 and trainer.engine._state is None  # freed after the rollout
    trainer.engine.restore_weights()  # the module fixture's model serves other tests: its own storage again
    assert not trainer.engine.shares_weights
    auto = Trainer(model, tok, make_task(cfg.data), preset("tiny-cpu", output_dir=str(tmp_path / "b"),
                                                             rollout=dict(engine="static")), progress="none")
    assert auto.engine.keep_cache and auto.engine.max_rows is None  # the CPU: not planned, the defaults
    assert auto.engine_memory.reason == "not planned on cpu"
    hf = Trainer(model, tok, make_task(cfg.data), preset("tiny-cpu", output_dir=str(tmp_path / "c")), progress="none")
    assert hf.engine_memory is None  # auto on the CPU is transformers' generate: nothing to choose
    gpu_config = preset("tiny-cpu", output_dir=str(tmp_path / "d"), rollout=dict(keep_cache=False, max_rows=16))
    with pytest.warns(UserWarning, match="rollout.keep_cache and rollout.max_rows set the static engine; "
                                         "rollout.engine 'auto' runs transformers' generate here"):
        Trainer(model, tok, make_task(cfg.data), gpu_config, progress="none")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_trainer_plans_the_engine_and_a_freed_cache_gives_its_memory_back(tmp_path):
    """The Trainer's auto path on CUDA: planned against this GPU (the tiny run fits: the defaults);
    with keep_cache false the KV cache is gone when the update starts, and the same step's
    rollouts come out either way."""
    from qerl_kit.lora import attach_lora
    from qerl_kit.tasks import make_task
    from qerl_kit.tiny import load_tiny
    from qerl_kit.trainer import Trainer

    rows = {}
    for keep in (None, False):
        model, tok = load_tiny(quantize="nvfp4", device="cuda", dtype=torch.bfloat16)
        model = attach_lora(model, r=4, seed=0)
        cfg = preset("tiny-cpu", output_dir=str(tmp_path / str(keep)), save_every=0,
                     rollout=dict(engine="static", batch_size=16, group_size=4, max_new_tokens=32, keep_cache=keep))
        trainer = Trainer(model, tok, make_task(cfg.data), cfg, progress="none")
        if keep is None:
            assert trainer.engine_memory.is_default and "planned peak" in trainer.engine_memory.reason
            assert trainer.engine_memory.planned_bytes <= torch.cuda.get_device_properties(0).total_memory
        seen = []
        generate = trainer.engine.generate_ids
        trainer.engine.generate_ids = lambda *a, **k: seen.append(generate(*a, **k)) or seen[-1]
        trainer.train_step()
        assert (trainer.engine._state is None) is (keep is False)
        rows[keep] = seen[0].completion_ids.cpu()
    assert torch.equal(rows[None], rows[False])
