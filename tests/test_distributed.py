"""Data-parallel GRPO on torch.distributed: two gloo processes on CPU against one process.

The two-rank runs are launched with ``torchrun`` (``python -m torch.distributed.run``) on this
very file (``__main__`` below is the worker). With ``GroupSeededEngine`` a step's samples do not
depend on the world size, so the adapter after a step on two ranks must equal the adapter after
the same step on one process, up to float32 summation order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_kit import distributed, runs  # noqa: E402
from qerl_kit.config import from_dict  # noqa: E402

# one step each on 2 ranks vs 1: the loss variants, and their normalizers
SCENARIOS = {
    "dapo": dict(loss=dict(loss="dapo", micro_batch=3)),
    "grpo": dict(loss=dict(loss="grpo", micro_batch=3, beta=0.05, mu=2, eps_high=0.28)),
    "dr_grpo": dict(loss=dict(loss="dr_grpo", micro_batch=5, scale_rewards="batch", is_correction=None)),
}


def _config(out: Path, **over):
    base = dict(rollout=dict(batch_size=8, group_size=2, max_new_tokens=6, temperature=1.0),
                loss=dict(loss="dapo", micro_batch=3), optim=dict(lr=5e-3),
                aqn=dict(enabled=True, stages=3), total_steps=3, save_every=1, output_dir=str(out))
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(base)


def _trainer(out: Path, **over):
    from qerl_kit.distributed import GroupSeededEngine
    from qerl_kit.rollout import HFEngine
    from qerl_kit.trainer import Trainer
    from tests.test_rollout import make_tokenizer
    from tests.test_trainer import TASK, _policy

    policy, tok = _policy(0), make_tokenizer()
    return Trainer(policy, tok, TASK, _config(out, **over), engine=GroupSeededEngine(HFEngine(policy, tok)),
                   progress="none")


def _adapter(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _assert_same_adapter(got: dict, want: dict):
    """Equal up to float32 summation order (all-reduce vs accumulation), amplified at most by Adam's
    g / sqrt(v) where a gradient is tiny: within 1e-3 of the learning rate (5e-3) per element."""
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=5e-6, msg=name)


def _close_rows(got: dict, want: dict):
    for key in ("reward", "reward_std", "accuracy", "loss", "grad_norm", "entropy", "num_tokens",
                "completions/mean_length", "frac_reward_zero_std"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


# ---- the worker: run under torchrun ---------------------------------------------------------------
def _worker(work: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = {}
    for name, over in SCENARIOS.items():  # a fresh first step in work/<name>
        trainer = _trainer(work / name, **over)
        assert trainer.dist.world == 2 and trainer.dist.rank == rank
        trainer.train(1)
        out[name] = {"row": trainer.history[-1], "adapter": _adapter(trainer)}
    # resume a checkpoint that one process wrote, and take step 2 (under AQN noise) on two ranks
    trainer = _trainer(work / "from1")
    assert trainer.resume() == 1
    trainer.train(1)
    out["from1"] = {"row": trainer.history[-1], "adapter": _adapter(trainer)}
    torch.save(out, work / f"rank{rank}.pt")
    distributed.shutdown()


def _torchrun(work: Path, nproc: int = 2) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "QERL_DIST_BACKEND": "gloo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           __file__, "--worker", str(work)]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process_and_resume_across_world_sizes(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    # one-process references: a first step of every scenario; for dapo also step 2 after a checkpoint
    ref = {}
    for name, over in SCENARIOS.items():
        trainer = _trainer(tmp_path / "ref" / name, **over)
        trainer.train(1)
        ref[name] = {"row": trainer.history[-1], "adapter": _adapter(trainer)}
        if name == "dapo":
            shutil.copytree(tmp_path / "ref" / name, work / "from1")  # checkpoint-1 by one process
            trainer.train(1)
            ref["step2"] = {"row": trainer.history[-1], "adapter": _adapter(trainer)}
    _torchrun(work)
    ranks = [torch.load(work / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for name in list(SCENARIOS) + ["from1"]:
        want = ref["step2" if name == "from1" else name]
        for got in ranks:  # both ranks hold the same adapter and the same reduced row
            _assert_same_adapter(got[name]["adapter"], want["adapter"])
            _close_rows(got[name]["row"], want["row"])
    assert ranks[0]["dapo"]["row"]["aqn/sigma"] == 0.0 and ranks[0]["from1"]["row"]["aqn/sigma"] > 0
    # rank 0 alone wrote the metrics and the checkpoint
    lines = (work / "dapo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1]
    assert sorted(p.name for p in (work / "dapo").iterdir()) == [runs.LOCK_FILE, "checkpoint-1", "metrics.jsonl", "run.json"]
    state = torch.load(work / "dapo" / "checkpoint-1" / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and state["step"] == 1
    lines = (work / "from1" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    # and a checkpoint two ranks wrote resumes on one process: step 2 as if never distributed
    one = _trainer(work / "dapo")
    assert one.resume() == 1
    one.train(1)
    _assert_same_adapter(_adapter(one), ref["step2"]["adapter"])
    _close_rows(one.history[-1], ref["step2"]["row"])


@pytest.mark.slow
def test_cli_train_runs_under_torchrun(tmp_path):
    """``qerl train --config X.yaml`` unchanged under the launcher: rank 0 alone writes."""
    cfg, out = tmp_path / "run.yaml", tmp_path / "run"
    cfg.write_text(f"preset: tiny-cpu\ntotal_steps: 3\nsave_every: 1\noutput_dir: {out}\n"
                   "rollout: {batch_size: 8, group_size: 2, max_new_tokens: 8}\n"
                   "data: {eval_size: 4, train_size: 100}\naqn: {stages: 3}\nloss: {micro_batch: 8}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "QERL_DIST_BACKEND": "gloo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "qerl_kit.cli", "train", "--config", str(cfg), "--steps", "1", "--no-widgets"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert res.stdout.count("linear layers converted") == 1  # printed by rank 0 only
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (out / "checkpoint-1" / "adapter_model.safetensors").is_file() and (out / "config.yaml").is_file()
    assert not list(out.glob(".tmp-*"))


# ---- plain unit tests (no process group) ------------------------------------------------------------
def test_group_slices_cover_the_batch_in_rank_order():
    assert [distributed.group_slice(8, r, 2) for r in (0, 1)] == [slice(0, 4), slice(4, 8)]
    assert [distributed.group_slice(6, r, 3) for r in range(3)] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert distributed.group_slice(5, 0, 1) == slice(0, 5)
    with pytest.raises(ValueError, match="do not split evenly"):
        distributed.group_slice(5, 0, 2)
    with pytest.raises(ValueError, match="not in a world"):
        distributed.group_slice(4, 2, 2)


def test_config_errors_name_the_fix(tmp_path):
    distributed.check_config(_config(tmp_path), 1)
    distributed.check_config(_config(tmp_path), 4)  # 8 = 4 x 2
    with pytest.raises(ValueError, match=r"divisible by world_size x group_size \(3 x 2 = 6\)"):
        distributed.check_config(_config(tmp_path), 3)
    with pytest.raises(ValueError, match="dynamic_sampling is not supported"):
        distributed.check_config(_config(tmp_path, filters=dict(dynamic_sampling=True)), 2)


def test_single_process_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init() is False and not distributed.active() and distributed.is_main()
    ctx = distributed.Context.detect()
    assert (ctx.rank, ctx.world, ctx.enabled) == (0, 1, False)
    x = torch.arange(4.0)
    assert ctx.all_gather(x) is x and ctx.sum(x) is x and ctx.broadcast("a") == "a" and ctx.any(True)
    row = {"step": 1, "loss": 0.5}
    assert distributed.reduce_metrics(row, ctx) is row
    assert distributed.wrap_ddp(torch.nn.Linear(2, 2), ctx) is None


def test_shutdown_frees_the_ddp_reducers_before_it_destroys_the_group(tmp_path, monkeypatch):
    """A wrapper still held (a Trainer the caller keeps) must not take the group down with it later,
    with the GIL held: its reducer goes first, while the group lives (distributed.shutdown)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = distributed.wrap_ddp(torch.nn.Linear(3, 2), distributed.Context(rank=0, world=2))
        ddp(torch.randn(4, 3)).sum().backward()  # a step's all-reduce ran through the reducer
        assert "reducer" in ddp.__dict__ and "logger" in ddp.__dict__
        seen = []
        destroy = dist.destroy_process_group
        monkeypatch.setattr(dist, "destroy_process_group",
                            lambda: (seen.append(("reducer" in ddp.__dict__, "logger" in ddp.__dict__)), destroy()))
        distributed.shutdown()
        assert seen == [(False, False)] and not dist.is_initialized()
        assert not distributed._WRAPPERS  # nothing left to free at the next shutdown
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_metric_reduction_ops():
    assert [distributed._op(k) for k in ("loss", "num_tokens", "rollout/tokens_per_s", "time/step", "memory/peak_gib",
                                         "clip_ratio/high_max", "clip_ratio/low_min", "reward")] == \
        ["sum", "sum", "sum", "max", "max", "max", "min", "mean"]


def test_group_seeded_engine_samples_a_group_the_same_in_any_batch():
    from qerl_kit.rollout import HFEngine, SamplingParams
    from tests.test_rollout import make_tokenizer
    from tests.test_trainer import _policy

    policy, tok = _policy(0), make_tokenizer()
    engine = distributed.GroupSeededEngine(HFEngine(policy, tok))
    sp = SamplingParams(max_new_tokens=5, seed=11)
    both = engine.generate(["ab", "cd"], 3, sp)
    alone = engine.generate(["cd"], 3, SamplingParams(max_new_tokens=5, seed=11 + distributed.SEED_STRIDE))
    assert both.texts[3:] == alone.texts
    with pytest.raises(ValueError, match="seeded"):
        engine.generate(["ab"], 2, SamplingParams(max_new_tokens=2))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
