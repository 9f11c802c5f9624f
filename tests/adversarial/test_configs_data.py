"""Configs, JSON Lines, model sources, the MATH reward's time budget and the widgets' agreement with
the trainer (issue #43, "Nothing silently wrong"; rows 76, 81, 92, 109, 110, 112 and 129 of
../shared/reference/qa-cases-2026-12-03.md).

- an empty YAML section under a preset keeps the preset's values (never the dataclass defaults);
- a JSON Lines file that is not UTF-8, or nests too deeply, is refused naming file:line; rows whose
  columns differ are refused at load (and by ``Task``), not at a later training step;
- every command that takes a model says "no such file or directory" for a missing path and
  "did you mean" for a preset typo, without a hub lookup;
- the MATH reward: model text never reaches sympy's ``parse_expr``, a boxed arithmetic expression is
  not the number it evaluates to, identical completions are scored once, and a call stops running
  math-verify past its time budget;
- the training dashboard's sliders and the trainer never disagree, in both directions, and the CPU
  notebooks set their thread count.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from qerl_kit import rewards as R
from qerl_kit.config import ConfigError, load_config, preset
from qerl_kit.data import load_gsm8k

ROOT = Path(__file__).resolve().parents[2]
TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"


# ----------------------------------------------------------------------------- configs

def test_case_92_empty_yaml_section_keeps_the_presets_values(tmp_path):
    cfg_file = tmp_path / "commented.yaml"
    cfg_file.write_text("preset: paper-gsm8k\nmodel:\n  # name: tiny\n  # lora_r: 8\noptim:\n  # lr: 1e-3\n")
    cfg, want = load_config(cfg_file), preset("paper-gsm8k")
    assert cfg.model == want.model and cfg.optim == want.optim
    assert cfg.model.name == "Qwen/Qwen2.5-7B-Instruct" and cfg.model.lora_r == 32
    assert cfg.optim.schedule == "cosine" and cfg.optim.warmup_ratio == 0.1 and cfg.optim.max_grad_norm == 0.2
    # the same rule from Python: None overrides nothing
    assert preset("paper-gsm8k", optim=None).optim == want.optim
    assert want.replace(model=None).model == want.model
    # an empty `preset:` is not "no preset"
    (tmp_path / "empty_preset.yaml").write_text("preset:\noptim: {lr: 1e-3}\n")
    with pytest.raises(ConfigError, match=r"preset must be one of 'tiny-cpu'.*got None"):
        load_config(tmp_path / "empty_preset.yaml")


# ----------------------------------------------------------------------------- JSON Lines

GOOD = json.dumps({"question": "1+1?", "answer": "so\n#### 2"})


def test_case_109_non_utf8_jsonl_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "non_utf8.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + '{"question": "caf\u00e9?", "answer": "#### 3"}'.encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not UTF-8") + r".*0xe9"):
        load_gsm8k(path)
    from qerl_kit.cli import main

    assert main(["eval", "--dataset", str(path)]) == 2  # one line from the CLI, before any model loads
    assert f"qerl eval: {path}:2: not UTF-8" in capsys.readouterr().err


def test_case_110_deep_nesting_names_file_and_line(tmp_path):
    path = tmp_path / "deep_nesting.jsonl"
    deep = '{"question": "q", "answer": "#### 1", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_text(GOOD + "\n" + GOOD + "\n" + deep + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: JSON nested too deeply")):
        load_gsm8k(path)
    # the same class: an integer past Python's int(str) digit limit is a ValueError of its own
    huge = tmp_path / "huge_int.jsonl"
    huge.write_text('{"question": "q", "answer": "#### 1", "n": ' + "9" * 5000 + "}\n")
    with pytest.raises(ValueError, match=re.escape(f"{huge}:1: unreadable JSON")):
        load_gsm8k(huge)


def test_case_112_rows_with_an_extra_column_are_refused_at_load(tmp_path):
    from qerl_kit.config import DataConfig
    from qerl_kit.tasks import Task, make_task

    rows = [json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}", **({"difficulty": 2} if i % 2 else {})})
            for i in range(6)]
    path = tmp_path / "mixed_alt.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: the columns differ") + r".*extra \['difficulty'\]"):
        load_gsm8k(path)
    with pytest.raises(ValueError, match=r"mixed_alt\.jsonl:2: .*difficulty"):
        make_task(DataConfig(dataset=str(path)))  # what `qerl train` reads: refused before any step
    # rows built in Python: the same check, naming the row
    with pytest.raises(ValueError, match=r"task 't': train row 1: .*missing \['answer'\]"):
        Task("t", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}], [], (R.gsm8k_reward,))


# ----------------------------------------------------------------------------- model sources

@pytest.fixture
def online_no_hub(tmp_path, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) in a folder holding qaw/; any model load fails loudly."""
    from qerl_kit import models

    (tmp_path / "qaw").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_load(*args, **kwargs):
        raise AssertionError("the hub was asked for a model name that is a typo or a missing path")

    monkeypatch.setattr(models, "load_model", no_load)
    return tmp_path


def test_case_129_quantize_missing_dir_and_mistyped_preset(online_no_hub, capsys):
    from qerl_kit.cli import main
    from qerl_kit.models import check_model_source

    assert main(["quantize", "qaw/nope"]) == 2
    err = capsys.readouterr().err
    assert "qerl quantize: model 'qaw/nope': no such file or directory" in err and "Traceback" not in err
    assert main(["quantize", "qwen2-tiyn"]) == 2
    err = capsys.readouterr().err
    assert "model 'qwen2-tiyn': no such file or directory (did you mean 'qwen2-tiny'?)" in err
    assert "'qwen2-tiny', 'qwen3-tiny', 'llama-tiny'" in err  # the presets quantize takes
    # every command that takes a model: the same check, the same words
    assert main(["eval", "--model", "qaw/nope"]) == 2
    assert "qerl eval: model 'qaw/nope': no such file or directory" in capsys.readouterr().err
    assert main(["train", "--model", "tiyn", "--output-dir", str(online_no_hub / "run")]) == 2
    assert "did you mean 'tiny'?" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="architecture preset"):
        check_model_source("qwen2-tiny", presets=("tiny",))  # train/eval need a tokenizer
    assert check_model_source("qwen2-tiny", presets=("qwen2-tiny",)) == "preset"
    assert check_model_source("some-org/some-model") == "hub"  # a hub id stays one when online


# ----------------------------------------------------------------------------- the MATH reward

def test_case_76_model_text_never_reaches_parse_expr(monkeypatch):
    import math_verify.parser as mvp
    import sympy.parsing.sympy_parser as sp

    seen: list[str] = []

    def spy(real):
        def parse_expr(s, *args, **kwargs):
            seen.append(s)
            return real(s, *args, **kwargs)
        return parse_expr

    monkeypatch.setattr(mvp, "parse_expr", spy(mvp.parse_expr))
    monkeypatch.setattr(sp, "parse_expr", spy(sp.parse_expr))
    for cached in (mvp.parse_expr_cached, mvp.parse_latex_cached):
        cached.cache_clear()  # an earlier test's parse must not hide this one's
    preds = ["\\boxed{ 9**9**9 }", "\\boxed{2*3+1}", "\\boxed{__import__('os').getcwd()}"]
    assert R.math_reward(None, preds[:2], answer=["7", "7"]) == [0.0, 0.0]  # model arithmetic is not evaluated
    assert R.math_reward(None, preds, answer=["x+1"] * 3) == [0.0, 0.0, 0.0]
    assert R.math_reward(None, ["\\boxed{1+x}"], answer=["x+1"]) == [1.0]  # math-verify still judges
    # what parse_expr may see: digit strings (latex2sympy's numbers) and sympy's own unit names, never
    # an expression the model wrote
    assert [s for s in seen if re.search(r"[*()'_=+]|import", s)] == [], seen


def test_case_81_identical_towers_are_scored_once_and_fast():
    t = time.monotonic()
    assert R.math_reward(None, [TOWER] * 16, answer=["3"] * 16) == [0.0] * 16
    assert time.monotonic() - t < 5  # was 32 s (16 x 2 s timeouts); generous for a busy CI box


def test_math_reward_scores_each_distinct_pair_once(monkeypatch):
    calls = []
    monkeypatch.setattr(R, "math_verify_equal", lambda g, p, *a: calls.append((g, p)) or (True, False))
    assert R.math_reward(None, [TOWER] * 16, answer=["x"] * 16) == [0.0] * 16
    assert len(calls) == 1


def test_math_reward_stops_verifying_past_its_budget(monkeypatch, caplog):
    clock, calls = [0.0], []

    def slow_verify(g, p, *a):  # each comparison "takes" 2 s of the fake clock
        calls.append(p)
        clock[0] += 2.0
        return True, False

    monkeypatch.setattr(R, "math_verify_equal", slow_verify)
    monkeypatch.setattr(R, "_clock", lambda: clock[0])
    towers = [f"\\boxed{{9^{{9^{{9^{{{k}}}}}}}}}" for k in range(16)]
    with caplog.at_level(logging.WARNING, logger="qerl_kit.rewards"):
        got = R.math_reward(None, towers + ["\\boxed{x}"], answer=["x"] * 17, budget_s=5)
    assert len(calls) == 3 and got == [0.0] * 16 + [1.0]  # string-equal answers are still scored
    assert "budget of 5 s ran out; 13 answer(s)" in caplog.text
    with pytest.raises(ValueError, match="budget_s must be"):
        R.math_reward(None, ["\\boxed{1}"], answer=["1"], budget_s=float("nan"))


# ----------------------------------------------------------------------------- widgets and notebooks

def test_dashboard_reads_a_value_set_on_the_trainer_from_code():
    pytest.importorskip("ipywidgets")
    from qerl_kit.widgets import TrainingDashboard
    from tests.test_widgets import _FakeTrainer

    trainer = _FakeTrainer()
    trainer.set_lr(2e-3)  # notebook 04's LR
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    assert dash.lr.value == pytest.approx(2e-3)
    trainer.set_lr(1e-3)  # from code, not through the slider
    trainer.aqn.sigma_start = 3e-3
    dash.run(1)  # the next chunk trains at what the trainer was given, and the slider shows it
    assert trainer.optimizer.param_groups[0]["initial_lr"] == 1e-3 and trainer.aqn.sigma_start == 3e-3
    assert dash.lr.value == pytest.approx(1e-3) and dash.sigma.value == 3e-3
    trainer.set_lr(1e-7)  # outside the slider's range: the range widens, the value is not clamped
    dash.sync_controls()
    assert dash.lr.value == pytest.approx(1e-7)


def test_dashboard_applies_a_moved_slider_at_once():
    pytest.importorskip("ipywidgets")
    import threading

    from qerl_kit.widgets import TrainingDashboard
    from tests.test_widgets import _FakeTrainer

    trainer = _FakeTrainer()
    dash = TrainingDashboard(trainer, redraw_every_s=0)
    dash.lr.value, dash.temp.value = 5e-4, 0.7
    assert trainer.optimizer.param_groups[0]["initial_lr"] == pytest.approx(5e-4)
    assert trainer.config.rollout.temperature == pytest.approx(0.7)
    assert "lr = 5.00e-04" in dash.live_label.value
    gate = threading.Event()  # during a chunk: applied when it ends, never halfway through a step
    trainer.gate = gate
    dash.run(2, background=True)
    dash.temp.value = 1.2
    assert trainer.config.rollout.temperature == pytest.approx(0.7)
    gate.set()
    dash.wait()
    assert trainer.config.rollout.temperature == pytest.approx(1.2) and dash.temp.value == pytest.approx(1.2)


@pytest.mark.parametrize("name", ["01_nvfp4_quantization", "02_lora_on_4bit", "03_aqn_exploration", "04_grpo_loop"])
def test_cpu_notebooks_set_their_thread_count(name):
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    setup = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and "import torch" in "".join(c["source"])]
    assert setup and "torch.set_num_threads(" in setup[0]
