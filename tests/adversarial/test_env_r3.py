"""Round 3 (issue #43): the memory planner, the kernel report, the experiment grid's command line,
``$QERL_THREADS`` and ``$QERL_DATA``.

Rows 11, 12, 24, 27, 28 and 29 of the third trial (2026-12-04): every argument of ``plan_memory`` is
checked where it enters by the shared rules (a ``ConfigError`` naming it; a model object is refused,
a string of targets is one name, never its letters); ``kernel_report``'s ``rows`` is a tuple of
ints >= 1; a flag value the grid refuses is a usage error (status 2), not a traceback;
``QERL_THREADS`` has one reader (``qerl_kit.threads``) that refuses what is not an int >= 1 in one
line naming it; ``qerl eval`` needs only a task's test split, and a ``$QERL_DATA`` that is a file is
said to be one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.adversarial._refusals import refused as _refused

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_nvfp4():
    from qerl_kit.models import build_model
    from qerl_kit.quantize import quantize_model

    model = build_model("qwen2-tiny")
    quantize_model(model)
    return model




# ---- row 11: plan_memory's values that cannot work ------------------------------------------------------
@pytest.mark.parametrize("key, value", [("lora_r", -8), ("rollout_batch", 0), ("max_new_tokens", -1),
                                        ("overhead", -0.5), ("gpu_bytes", -1), ("kv_bytes", 0),
                                        ("micro_batch", 10**9), ("act_bytes", 3), ("prompt_len", -1)])
def test_r3_11_plan_memory_refuses_values_that_cannot_work(key, value):
    """plan_memory("Qwen2.5-7B", lora_r=-8); also rollout_batch=0, max_new_tokens=-1, overhead=-0.5,
    gpu_bytes=-1, kv_bytes=0, micro_batch=10**9 (more than the rollout batch), act_bytes=3, prompt_len=-1."""
    from qerl_kit.memory_plan import plan_memory

    _refused(lambda: plan_memory("Qwen2.5-7B", **{key: value}), f"{key} must be", f"got {value!r}")


def test_r3_11_a_small_batch_keeps_the_default_micro_batch_valid():
    """plan_memory("Qwen2.5-7B", rollout_batch=4): the default micro-batch (8) is cut to the batch, not refused."""
    from qerl_kit.memory_plan import plan_memory

    assert plan_memory("Qwen2.5-7B", rollout_batch=4).settings["micro_batch"] == 4
    assert plan_memory("Qwen2.5-7B", rollout_batch=4, micro_batch=4).peak == plan_memory(
        "Qwen2.5-7B", rollout_batch=4).peak
    # a dict of sizes is checked too: a negative vocabulary is no shape
    sizes = dict(vocab_size=-1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    _refused(lambda: plan_memory(sizes), "model.vocab_size must be an int >= 1", "got -1")


# ---- row 12: plan_memory's arguments of the wrong kind ----------------------------------------------------
def test_r3_12_plan_memory_names_arguments_of_the_wrong_kind(tiny_nvfp4):
    """plan_memory(overhead=float('nan')); gpu_bytes="80GB"; plan_memory(build_model("qwen2-tiny"));
    targets="q_proj" (one name, not the letters q, _, p ...)."""
    from qerl_kit.memory_plan import plan_memory

    _refused(lambda: plan_memory(overhead=float("nan")), "overhead must be a finite float", "got nan")
    _refused(lambda: plan_memory(gpu_bytes="80GB"), "gpu_bytes must be", "in bytes", "got '80GB'")
    _refused(lambda: plan_memory(tiny_nvfp4), "model must be a preset name", "Qwen2ForCausalLM", ".config")
    _refused(lambda: plan_memory({"hidden_size": 64}), "model must be", "has no vocab_size")
    one = plan_memory("Qwen2.5-7B", targets="q_proj")
    assert one.parts == plan_memory("Qwen2.5-7B", targets=("q_proj",)).parts
    msg = _refused(lambda: plan_memory(targets="qproj"), "targets: 'qproj' matches no LoRA target", "'q_proj'")
    assert "'_'" not in msg
    _refused(lambda: plan_memory(targets=()), "targets must be a non-empty list")
    _refused(lambda: plan_memory(fmt=None), "fmt must be one of", "'nvfp4'")
    _refused(lambda: plan_memory("Qwen2.5-7B").fits("80GB"), "gpu_bytes must be")


# ---- row 24: kernel_report's rows ----------------------------------------------------------------------
@pytest.mark.parametrize("rows, words", [((-4,), ["rows[0] must be an int in [1,", "got -4"]),
                                         (4, ["rows must be a non-empty tuple of ints", "got 4"]),
                                         ((), ["rows must be a non-empty tuple"]),
                                         ((2.5,), ["rows[0] must be an int", "got 2.5"])])
def test_r3_24_kernel_report_checks_rows(tiny_nvfp4, rows, words):
    """kernel_report(m, rows=(-4,)); kernel_report(m, rows=4); rows=(); rows=(2.5,)."""
    from qerl_kit.kernel_report import kernel_report

    _refused(lambda: kernel_report(tiny_nvfp4, rows=rows), *words)
    assert kernel_report(tiny_nvfp4, rows=[1, 64]).rows == (1, 64)  # a list of valid counts is fine


# ---- row 27: the grid's flag values are usage errors -----------------------------------------------------
def test_r3_27_experiments_unknown_dataset_is_a_usage_error(tmp_path, capsys):
    """python -m qerl_kit.experiments --grid smoke --dataset countdwn --out ex_ds"""
    from qerl_kit.experiments import main

    with pytest.raises(SystemExit) as exit_:
        main(["--grid", "smoke", "--dataset", "countdwn", "--out", str(tmp_path / "ex_ds")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "error: data.dataset must be one of" in err and "'countdwn'" in err and "Traceback" not in err
    assert not (tmp_path / "ex_ds").exists()


# ---- row 28: QERL_THREADS --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["abc", "-3", "0", "2.5"])
def test_r3_28_qerl_threads_is_checked_by_one_reader(monkeypatch, value):
    """QERL_THREADS=abc (and -3, 0, 2.5): one ConfigError naming QERL_THREADS and the value."""
    from qerl_kit.threads import cpu_threads

    monkeypatch.setenv("QERL_THREADS", value)
    _refused(cpu_threads, "QERL_THREADS must be an int in [1,", f"got {value!r}")
    monkeypatch.setenv("QERL_THREADS", " 3 ")
    assert cpu_threads() == 3


@pytest.mark.parametrize("value", ["abc", "-3"])
def test_r3_28_qerl_threads_in_demo_and_grid_is_one_line(tmp_path, monkeypatch, capsys, value):
    """QERL_THREADS=abc qerl demo --steps 1 --eval-size 2 --output-dir dm1 (also the grid); QERL_THREADS=-3."""
    from qerl_kit import experiments
    from qerl_kit.cli import main

    monkeypatch.setenv("QERL_THREADS", value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the variable is read on a CPU only
    assert main(["demo", "--steps", "1", "--eval-size", "2", "--output-dir", str(tmp_path / "dm1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl demo: QERL_THREADS must be") and f"got {value!r}" in err and err.count("\n") == 1
    assert not (tmp_path / "dm1").exists()
    with pytest.raises(SystemExit) as exit_:
        experiments.main(["--grid", "smoke", "--device", "cpu", "--out", str(tmp_path / "ex")])
    assert exit_.value.code == 2 and "error: QERL_THREADS must be" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["01_nvfp4_quantization", "02_lora_on_4bit", "03_aqn_exploration", "04_grpo_loop"])
def test_r3_28_notebooks_read_qerl_threads_through_the_one_reader(name):
    """Notebooks 01-04 under QERL_THREADS=abc: their setup cell calls qerl_kit.threads.cpu_threads."""
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    setup = next("".join(c["source"]) for c in nb["cells"]
                 if c["cell_type"] == "code" and "import torch" in "".join(c["source"]))
    assert "torch.set_num_threads(cpu_threads())" in setup and 'os.environ.get("QERL_THREADS"' not in setup


# ---- row 29: $QERL_DATA ----------------------------------------------------------------------------------
def _gsm(path, n):
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(n)))
    return path


class _Loaded(Exception):
    """Raised where the model would start loading: the data step before it passed."""


def test_r3_29_eval_needs_only_the_test_split(tmp_path, monkeypatch, capsys):
    """QERL_DATA=onlytest (a folder holding only gsm8k_test.jsonl), qerl eval --dataset gsm8k --limit 1."""
    from qerl_kit.cli import main
    from qerl_kit.config import DataConfig, TrainConfig
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    folder = tmp_path / "onlytest"
    folder.mkdir()
    _gsm(folder / "gsm8k_test.jsonl", 3)
    monkeypatch.setenv("QERL_DATA", str(folder))
    task = make_task(DataConfig(dataset="gsm8k", eval_size=2))
    assert [r["answer"] for r in task.eval] == ["0", "1"] and task.train == []

    def loading(*args, **kwargs):
        raise _Loaded
    monkeypatch.setattr("qerl_kit.build.load_base", loading)
    with pytest.raises(_Loaded):  # past the data: evaluation goes on to load the model
        main(["eval", "--dataset", "gsm8k", "--limit", "1"])
    # training is what needs the train split: refused in one line naming the file it looked for
    with pytest.raises(ValueError, match=r"task 'gsm8k' has no training rows \(gsm8k split 'train': no "
                                         r"gsm8k_train\.jsonl in .*onlytest"):
        Trainer(torch.nn.Linear(1, 1), None, task, TrainConfig())


def test_r3_29_qerl_data_pointing_at_a_file_says_so(tmp_path, monkeypatch, capsys):
    """QERL_DATA=onlytest/gsm8k_test.jsonl (a file, not a folder), qerl eval --dataset gsm8k --limit 1."""
    from qerl_kit.cli import main

    data = _gsm(tmp_path / "gsm8k_test.jsonl", 2)
    monkeypatch.setenv("QERL_DATA", str(data))
    assert main(["eval", "--dataset", "gsm8k", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qerl eval: QERL_DATA=") and "is a file, not a folder" in err and err.count("\n") == 1
    monkeypatch.setenv("QERL_DATA", str(tmp_path / "missing"))  # a folder that is not there is said too
    assert main(["eval", "--dataset", "gsm8k", "--limit", "1"]) == 2
    assert "(no such folder)" in capsys.readouterr().err
