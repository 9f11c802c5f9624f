"""Files: checkpoints, adapters, run directories and exports (issue "Nothing silently wrong").

Every loader of an adapter goes through the checked loader (``qerl eval --adapter`` as resume:
truncated, missing, partial, extra-tensor, misshaped and NaN adapters are refused naming the path);
a damaged ``trainer_state.pt`` is a ``CheckpointError`` naming the path and the key; a run directory
belongs to one live process (a lock a crashed run does not leave stuck); the final re-save never
leaves a run without a complete checkpoint; weights get the umask's mode; a crashed export's hidden
leftovers are cleaned (or put back) by the next export; a full disk is said, naming the path; a
dangling-symlink output_dir is named before the model loads. Rows of
../shared/reference/qa-cases-2026-12-03.md: 63, 64, 65, 86, 87, 90, 91, 96, 97, 98, 99, 102, 106.
"""

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl_kit import checkpoint as ckpt
from qerl_kit import runs
from qerl_kit.adapter_files import ADAPTER_FILE
from qerl_kit.checkpoint import CheckpointError
from qerl_kit.cli import main
from tests.test_trainer import _trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ROOT = Path(__file__).resolve().parents[2]


# ---- qerl eval --adapter: the checked loader (rows 63, 64, 65, 98, 99) ---------------------------
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A good adapter of the 'tiny' model as ``qerl eval`` builds it (nvfp4 base, LoRA r=4)."""
    from qerl_kit.build import load_base
    from qerl_kit.config import ModelConfig
    from qerl_kit.lora import attach_lora
    from qerl_kit.quantize import quantize_model

    model, _ = load_base(ModelConfig(name="tiny"))
    quantize_model(model, fmt="nvfp4")
    path = tmp_path_factory.mktemp("adapters") / "good"
    attach_lora(model, r=4, seed=0).save_pretrained(str(path))
    return path


def _damaged(adapter, tmp_path, edit):
    """A copy of the good adapter with its tensors changed by ``edit(weights) -> weights``."""
    path = tmp_path / "ev"
    shutil.copytree(adapter, path)
    weights = load_file(str(path / ADAPTER_FILE))
    save_file(edit(weights), str(path / ADAPTER_FILE))
    return path


def _eval(path, capsys):
    capsys.readouterr()
    rc = main(["eval", "--adapter", str(path), "--limit", "1", "--max-new-tokens", "2", "--device", "cpu"])
    return rc, capsys.readouterr().err


def test_case_63_eval_truncated_adapter_names_the_file(adapter, tmp_path, capsys):
    path = tmp_path / "trunc"
    shutil.copytree(adapter, path)
    data = (path / ADAPTER_FILE).read_bytes()
    (path / ADAPTER_FILE).write_bytes(data[: len(data) // 2])
    rc, err = _eval(path, capsys)
    assert rc == 2
    assert f"{path / ADAPTER_FILE} cannot be read" in err and "damaged or truncated" in err


def test_case_64_eval_missing_weights_file_is_named_never_a_hub_lookup(adapter, tmp_path, capsys):
    path = tmp_path / "noweights"
    shutil.copytree(adapter, path)
    (path / ADAPTER_FILE).unlink()
    rc, err = _eval(path, capsys)
    assert rc == 2 and f"{path / ADAPTER_FILE} is missing" in err


def test_eval_adapter_dir_that_does_not_exist_is_named(tmp_path, capsys):
    rc, err = _eval(tmp_path / "nowhere", capsys)
    assert rc == 2 and f"adapter {tmp_path / 'nowhere'} is not a directory" in err


def test_case_65_eval_adapter_missing_a_layers_tensors_is_refused(adapter, tmp_path, capsys):
    def drop_a_layer(weights):
        layer = max(int(m.group(1)) for k in weights if (m := re.search(r"\.layers\.(\d+)\.", k)))
        return {k: v for k, v in weights.items() if f".layers.{layer}." not in k}

    path = _damaged(adapter, tmp_path, drop_a_layer)
    rc, err = _eval(path, capsys)
    assert rc == 2 and f"{path / ADAPTER_FILE} does not match the model's adapter" in err
    assert re.search(r"\d+ adapter tensors missing \(e\.g\. .*layers\.\d+\.", err)


def test_case_98_eval_all_nan_adapter_is_refused(adapter, tmp_path, capsys):
    path = _damaged(adapter, tmp_path, lambda w: {k: torch.full_like(v, float("nan")) for k, v in w.items()})
    rc, err = _eval(path, capsys)
    assert rc == 2 and f"{path / ADAPTER_FILE} holds NaN or inf values" in err and "lora_" in err


def test_case_99_eval_adapter_with_an_extra_tensor_is_refused(adapter, tmp_path, capsys):
    path = _damaged(adapter, tmp_path, lambda w: {**w, "base_model.model.extra.lora_A.weight": torch.zeros(2, 2)})
    rc, err = _eval(path, capsys)
    assert rc == 2 and "1 tensors the model has no place for (e.g. base_model.model.extra.lora_A.weight)" in err


def test_load_lora_refuses_a_misshaped_tensor_and_leaves_the_model_unwrapped(adapter, tmp_path):
    from qerl_kit.build import load_base
    from qerl_kit.config import ModelConfig
    from qerl_kit.lora import load_lora
    from qerl_kit.quantize import quantize_model

    def widen(weights):
        key = sorted(weights)[0]
        return {**weights, key: torch.zeros(weights[key].shape[0] + 1, *weights[key].shape[1:])}

    path = _damaged(adapter, tmp_path, widen)
    model, _ = load_base(ModelConfig(name="tiny"))
    quantize_model(model, fmt="nvfp4")
    with pytest.raises(CheckpointError, match="1 of another shape"):
        load_lora(model, str(path))
    assert not any("lora_" in name for name, _ in model.named_parameters())
    loaded = load_lora(model, str(adapter))  # the good one loads, frozen for inference
    assert any("lora_" in n for n, _ in loaded.named_parameters())
    assert not any(p.requires_grad for p in loaded.parameters())


# ---- resume: the trainer state and the adapter (rows 96, 97) ------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of one training step (its directory is copied before each damage)."""
    trainer = _trainer(tmp_path_factory.mktemp("saved"), save_every=0)
    trainer.train(1)
    return trainer.save()


def _copy(saved, tmp_path):
    path = tmp_path / "run" / saved.name
    shutil.copytree(saved, path)
    return path


@pytest.mark.parametrize("damage,key", [
    (lambda s: s.pop("optimizer"), "optimizer"),
    (lambda s: s.update(step="five"), "step"),
    (lambda s: s.update(history="not json{"), "history"),
])
def test_case_96_damaged_trainer_state_names_path_and_key(saved, tmp_path, damage, key):
    path = _copy(saved, tmp_path)
    state = torch.load(path / ckpt.STATE_FILE, weights_only=True)
    damage(state)
    torch.save(state, path / ckpt.STATE_FILE)
    with pytest.raises(CheckpointError, match=re.escape(str(path / ckpt.STATE_FILE)) + f".*'{key}'"):
        _trainer(tmp_path).resume(path)


def test_case_97_resume_from_an_all_nan_adapter_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    weights = load_file(str(path / ADAPTER_FILE))
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, str(path / ADAPTER_FILE))
    with pytest.raises(CheckpointError, match=re.escape(str(path / ADAPTER_FILE)) + " holds NaN or inf values"):
        _trainer(tmp_path).resume(path)


# ---- the final re-save and a full disk (rows 86, 87) --------------------------------------------
class _Killed(BaseException):
    """A crash at a chosen point (BaseException: nothing catches it, as nothing catches SIGKILL)."""


def test_case_86_a_crash_in_the_final_re_save_keeps_a_complete_checkpoint(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, save_every=1, keep_checkpoints=1)
    trainer.train(2)  # checkpoint-2 saved, checkpoint-1 pruned (keep 1)
    real = Path.rename

    def rename(self, target):
        if self.name == ".tmp-checkpoint-2":
            raise _Killed  # the re-save's tmp -> checkpoint-2 never happens
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(_Killed):
        trainer.save()  # the CLI's final save, at the step just saved
    monkeypatch.undo()
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert latest is not None and latest.name == "checkpoint-2"
    assert _trainer(tmp_path, save_every=1, keep_checkpoints=1).resume() == 2


@pytest.mark.parametrize("failure", ["enospc", "torch_unexpected_pos"])
def test_case_87_disk_full_during_a_checkpoint_says_so_and_loses_nothing(tmp_path, monkeypatch, failure):
    trainer = _trainer(tmp_path, save_every=1)
    trainer.train(1)
    before = (tmp_path / "run" / "checkpoint-1" / ckpt.STATE_FILE).read_bytes()

    def full(*args, **kwargs):
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1147328 vs 1147220")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(6 << 20, 6 << 20, 0))
    with pytest.raises(OSError) as info:
        trainer.train(1)
    assert info.value.errno == errno.ENOSPC
    assert f"no space left on device while writing {tmp_path / 'run'}" in str(info.value)
    assert not (tmp_path / "run" / ".tmp-checkpoint-2").exists()  # the partial copy is removed
    assert (tmp_path / "run" / "checkpoint-1" / ckpt.STATE_FILE).read_bytes() == before


def test_disk_full_during_an_export_names_the_path_and_keeps_the_earlier_export(tmp_path, monkeypatch):
    import safetensors.torch

    from qerl_kit.export import save_nvfp4

    out = tmp_path / "kexp"
    save_nvfp4(_quantized(), out)
    before = (out / "model.safetensors").read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="no space left on device while writing " + re.escape(str(out))):
        save_nvfp4(_quantized(), out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kexp"]


# ---- file modes (row 91) --------------------------------------------------------------------------
def _quantized():
    from qerl_kit.models import build_model
    from qerl_kit.quantize import quantize_model

    model = build_model("qwen2-tiny", seed=0)
    quantize_model(model)
    return model


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_case_91_weights_get_the_same_mode_as_every_other_file(tmp_path, umask):
    from qerl_kit.export import save_nvfp4

    old = os.umask(umask)
    try:
        save_nvfp4(_quantized(), tmp_path / "exp1")
        trainer = _trainer(tmp_path, save_every=0)
        trainer.step = 4  # no training needed to write a checkpoint
        path = trainer.save()
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    for f in [*(tmp_path / "exp1").iterdir(), *path.iterdir()]:
        assert f.stat().st_mode & 0o777 == want, f


# ---- a crashed export's leftovers (row 90) -------------------------------------------------------
def _hidden(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def _export_killed_at(out, point):
    """Run save_nvfp4 to ``out`` in a forked child that SIGKILLs itself at ``point``."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            import safetensors.torch

            from qerl_kit import export_dirs
            from qerl_kit.export import save_nvfp4

            def die(*_args, **_kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            if point == "staging":  # after the first shard is written
                real = safetensors.torch.save_file
                safetensors.torch.save_file = lambda *a, **k: (real(*a, **k), die())
            elif point == "between_renames":  # the earlier export renamed aside, the new one not yet in
                real_rename = os.rename
                os.rename = lambda a, b: die() if ".qerl-tmp-" in str(a) else real_rename(a, b)
            else:  # after the swap, before the earlier export aside is deleted
                export_dirs._remove_listed = die
            save_nvfp4(_quantized(), out, max_shard_size=20_000)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("point", ["staging", "between_renames", "after_swap"])
def test_case_90_a_killed_export_leaves_nothing_behind_after_the_next_run(tmp_path, monkeypatch, point):
    from qerl_kit import ct_format
    from qerl_kit.export import load_nvfp4, save_nvfp4

    out = tmp_path / "kx"
    save_nvfp4(_quantized(), out, max_shard_size=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _export_killed_at(out, point)
    assert _hidden(tmp_path)  # the crash left a hidden sibling

    def failing(*args, **kwargs):
        raise RuntimeError("the next run fails too")

    with monkeypatch.context() as m:  # a next run that fails while writing still finds the earlier export
        m.setattr(ct_format, "write_safetensors", failing)
        with pytest.raises(RuntimeError, match="the next run fails too"):
            save_nvfp4(_quantized(), out, max_shard_size=20_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _hidden(tmp_path) == []
    save_nvfp4(_quantized(), out, max_shard_size=20_000)
    assert _hidden(tmp_path) == [] and load_nvfp4(out) is not None


# ---- one process per run directory; a dangling output_dir (rows 102, 106) ------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    """``qerl train`` must refuse before the model loads: loading it fails the test."""
    import qerl_kit.build

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output directory was refused")

    monkeypatch.setattr(qerl_kit.build, "build_policy", load)


def test_case_102_a_second_live_run_in_the_same_dir_is_refused_at_once(tmp_path, capsys, no_model_load):
    out = tmp_path / "r_conc"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from qerl_kit import runs; runs.lock(sys.argv[1]); print('locked', "
         "flush=True); sys.stdin.read()", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc = main(["train", "--output-dir", str(out), "--steps", "1", "--no-widgets"])
        err = capsys.readouterr().err
        assert rc == 2 and f"{out} is in use by another live run (process {holder.pid} holds" in err
        assert not (out / runs.RUN_FILE).exists()  # nothing of the refused run was written
    finally:
        holder.kill()  # a crash: the OS drops its lock
        holder.wait()
    runs.lock(out)  # a crashed run's lock is not stuck


def test_the_run_lock_refuses_a_second_holder_in_the_same_process(tmp_path):
    from qerl_kit import locks

    first = locks.try_lock(tmp_path / "l")
    try:
        assert first is not None and locks.try_lock(tmp_path / "l") is None
        assert locks.holder(tmp_path / "l") == str(os.getpid())
    finally:
        locks.release(first)
    again = locks.try_lock(tmp_path / "l")
    assert again is not None
    locks.release(again)


def test_case_106_dangling_symlink_output_dir_is_named_before_the_model_loads(tmp_path, capsys, no_model_load):
    link = tmp_path / "out_dangling"
    link.symlink_to("does_not_exist")
    rc = main(["train", "--output-dir", str(link), "--steps", "1", "--no-widgets"])
    err = capsys.readouterr().err
    assert rc == 2 and f"output_dir {link} is a symlink to does_not_exist, which does not exist" in err
    assert link.is_symlink() and not link.exists()
