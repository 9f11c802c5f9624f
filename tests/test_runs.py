"""Nothing lost, nothing silently wrong: run directories, checkpoints that are checked on resume,
config changes on resume, reward functions that return the wrong number of scores."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_kit.adapter_files import ADAPTER_FILE
from qerl_kit import checkpoint as ckpt
from qerl_kit import runs
from qerl_kit.checkpoint import CheckpointError
from tests.test_trainer import DATA, _config, _policy, _prompt, _trainer, first_char_reward
from tests.test_rollout import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _steps(path):
    return [json.loads(x)["step"] for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_new_run_in_a_used_directory_moves_the_old_run_aside_and_keeps_its_own_checkpoints(tmp_path):
    run = tmp_path / "run"
    old = _trainer(tmp_path, save_every=2)
    old.train(4)                                   # checkpoints 2 and 4, metrics 1..4
    new = _trainer(tmp_path, save_every=1, total_steps=6)
    new.train(1)                                   # a fresh run (no resume) into the same directory
    # before: the new run's checkpoint-1 was pruned at once (the old 2 and 4 were "newer") and
    # metrics.jsonl held 1, 2, 3, 4, 1
    assert ckpt.list_checkpoints(run) == [run / "checkpoint-1"]
    assert _steps(run) == [1]
    [moved] = (run / runs.PREVIOUS).iterdir()
    assert sorted(p.name for p in ckpt.list_checkpoints(moved)) == ["checkpoint-2", "checkpoint-4"]
    assert _steps(moved) == [1, 2, 3, 4] and runs.read_run(moved)["run_id"] == old.run_id
    # the next plain resume continues the new run, not the old one
    again = _trainer(tmp_path, save_every=1, total_steps=6)
    assert again.resume() == 1 and again.run_id == new.run_id


def test_pruning_removes_only_this_runs_older_checkpoints(tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(tmp_path, save_every=1, keep_checkpoints=2)
    foreign = run / "checkpoint-9"                 # a checkpoint another run left (no run.json of ours)
    foreign.mkdir(parents=True)
    (foreign / ckpt.STATE_FILE).write_bytes(b"x")
    runs.write_run(run, trainer.run_id, "train")   # the directory is this run's
    trainer.train(3)
    assert sorted(p.name for p in ckpt.list_checkpoints(run)) == ["checkpoint-2", "checkpoint-3", "checkpoint-9"]


def test_claim_refuses_our_file_names_held_by_files_that_are_not_a_run(tmp_path):
    (tmp_path / "config.yaml").write_text("my: own settings\n")
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="config.yaml, which are not a qerl run's files"):
        runs.claim(tmp_path, "abc", "train")
    assert (tmp_path / "config.yaml").read_text() == "my: own settings\n"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert runs.claim(other, "abc", "train") is None           # other names are left alone
    assert (other / "notes.txt").read_text() == "keep me" and runs.read_run(other)["run_id"] == "abc"


def test_demo_and_train_have_their_own_default_directories():
    from qerl_kit.cli import build_parser
    from qerl_kit.config import TrainConfig

    demo = build_parser().parse_args(["demo"])
    assert demo.output_dir == "runs/demo" and TrainConfig().output_dir == "runs/train"


def test_train_says_on_its_first_line_which_run_it_resumes(tmp_path, capsys):
    from qerl_kit.cli import main

    cfg = tmp_path / "run.yaml"
    out = tmp_path / "run"
    cfg.write_text(f"preset: tiny-cpu\ntotal_steps: 3\nsave_every: 1\noutput_dir: {out}\n"
                   "rollout: {batch_size: 8, group_size: 4, max_new_tokens: 8}\n"
                   "data: {eval_size: 4, train_size: 50}\naqn: {stages: 3}\n")
    assert main(["train", "--config", str(cfg), "--steps", "1", "--no-widgets"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"qerl train: starting a new run in {out}"
    assert main(["train", "--config", str(cfg), "--steps", "1", "--no-widgets"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"qerl train: resuming the run in {out} from step 1 ({out / 'checkpoint-1'})"
    # a changed config is refused on resume (exit 2, the checkpoint named), unless allowed
    cfg.write_text(cfg.read_text().replace("total_steps: 3", "total_steps: 4"))
    assert main(["train", "--config", str(cfg), "--steps", "1", "--no-widgets"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint-2" in err and "total_steps: 3 -> 4" in err and "--allow-config-change" in err
    assert main(["train", "--config", str(cfg), "--steps", "1", "--no-widgets", "--allow-config-change"]) == 0
    line = json.loads((out / "config_changes.jsonl").read_text().splitlines()[0])
    assert line["step"] == 2 and line["changes"] == {"total_steps": [3, 4]}
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--fresh", "--steps", "1", "--no-widgets"]) == 0
    out_text = capsys.readouterr().out
    assert out_text.splitlines()[0].startswith(f"qerl train: starting a new run in {out}; the run found there moves")
    assert len(list((out / runs.PREVIOUS).iterdir())) == 1 and _steps(out) == [1]


@pytest.fixture
def saved(tmp_path):
    trainer = _trainer(tmp_path, save_every=0)
    trainer.train(1)
    return trainer, trainer.save()


def test_a_checkpoint_missing_an_adapter_tensor_is_refused_with_its_name(tmp_path, saved):
    _, path = saved
    weights = load_file(str(path / ADAPTER_FILE))
    dropped = sorted(weights)[0]
    del weights[dropped]
    save_file(weights, str(path / ADAPTER_FILE))
    with pytest.raises(CheckpointError, match=re.escape(f"{path / ADAPTER_FILE} does not match the model's adapter: "
                                                        f"1 adapter tensors missing (e.g. {dropped})")):
        _trainer(tmp_path).resume(path)


def test_unexpected_or_wrongly_shaped_tensors_are_refused(tmp_path, saved):
    _, path = saved
    weights = load_file(str(path / ADAPTER_FILE))
    key = sorted(weights)[0]
    weights[key] = torch.zeros(weights[key].shape[0] + 1, *weights[key].shape[1:])
    weights["base_model.model.extra.lora_A.weight"] = torch.zeros(2, 2)
    save_file(weights, str(path / ADAPTER_FILE))
    with pytest.raises(CheckpointError, match="1 tensors the model has no place for.*1 of another shape"):
        _trainer(tmp_path).resume(path)


@pytest.mark.parametrize("name", [ADAPTER_FILE, ckpt.STATE_FILE])
def test_a_truncated_file_names_its_path(tmp_path, saved, name):
    _, path = saved
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(str(path / name)) + " cannot be read .* damaged or truncated"):
        _trainer(tmp_path).resume(path)


def test_a_config_change_on_resume_is_refused_or_applied_consistently(tmp_path, saved):
    trainer, path = saved
    changed = dict(optim=dict(lr=1e-3), total_steps=12, aqn=dict(stages=4))
    with pytest.raises(CheckpointError, match=r"optim.lr: 0.005 -> 0.001"):
        _trainer(tmp_path, **changed).resume(path)
    same_but_neutral = _trainer(tmp_path, save_every=5, eval_every=3)   # only resume-neutral keys differ
    assert same_but_neutral.resume(path) == 1
    with pytest.warns(UserWarning, match="changed config"):
        resumed = _trainer(tmp_path, **changed)
        resumed.resume(path, allow_config_change=True)
    # before: the optimizer kept the old lr (0.005) while config.yaml claimed the new one, and AQN
    # kept the old total_steps while the lr schedule used the new
    want = 1e-3 * resumed.scheduler.lr_lambdas[0](resumed.scheduler.last_epoch)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == pytest.approx([want] * len(resumed.optimizer.param_groups))
    assert resumed.aqn.total_steps == 12 and resumed.aqn.stages == 4
    line = json.loads((tmp_path / "run" / "config_changes.jsonl").read_text())
    assert line["changes"]["optim.lr"] == [0.005, 0.001] and line["changes"]["total_steps"] == [6, 12]


@pytest.mark.parametrize("bad,error,match", [
    (lambda n: None, TypeError, "returned None"),
    (lambda n: [1.0] * (n + 1), ValueError, "returned 9 scores for 8 completions"),
    (lambda n: [1.0] * (n - 1), ValueError, "returned 7 scores for 8 completions"),
    (lambda n: ["1"] * n, TypeError, "returned a score of type str"),
])
def test_a_reward_function_returning_the_wrong_scores_is_named(tmp_path, bad, error, match):
    def picky_reward(prompts, completions, **_):
        return bad(len(completions))

    from qerl_kit.tasks import Task
    from qerl_kit.trainer import Trainer

    task = Task("picky", DATA, [], (first_char_reward, picky_reward), _prompt)
    trainer = Trainer(_policy(), make_tokenizer(), task, _config(tmp_path), progress="none")
    with pytest.raises(error, match=f"reward function 'picky_reward' {match}"):
        trainer.train(1)


def test_a_config_key_newer_than_the_checkpoint_is_not_a_change_at_its_default():
    saved = {"optim": {"lr": 0.1}, "aqn": {"enabled": True}}
    current = {"optim": {"lr": 0.1}, "aqn": {"enabled": True, "allow_increasing": False}}
    defaults = {"optim": {"lr": 0.2}, "aqn": {"enabled": False, "allow_increasing": False}}
    assert ckpt.config_changes(saved, current, defaults) == {}
    current["aqn"]["allow_increasing"] = True
    assert ckpt.config_changes(saved, current, defaults) == {"aqn.allow_increasing": (False, True)}


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_a_prompt_longer_than_the_context_is_an_error_not_garbage(engine):
    from qerl_kit.rollout import SamplingParams, make_engine

    model = _policy()                                    # qwen2-tiny: max_position_embeddings = 512
    eng = make_engine(engine, model, make_tokenizer())
    sampling = SamplingParams(max_new_tokens=20, seed=0)
    assert len(eng.generate(["ab" * 200], 1, sampling).texts) == 1           # 400 + 20 positions fit
    with pytest.raises(ValueError, match=r"prompt 1 has 500 tokens; with max_new_tokens=20 it needs 520 positions, "
                                         r"more than the model's context \(max_position_embeddings=512\)"):
        eng.generate(["ab", "ab" * 250], 1, sampling)
