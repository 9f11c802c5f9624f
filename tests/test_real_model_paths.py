"""Issue #42's traps, closed: the paths a real model takes through qerl_kit, tested on small models.

* 4-bit generation on the CPU dequantizes each weight once per call (``qerl_kit.dense_cache``),
  with exactly the outputs of the uncached path;
* the StaticEngine frees a dropped state's graphs at once (the reference cycle that the cyclic GC
  used to collect inside a later CUDA-graph capture: the Trainer.evaluate() crash);
* evaluation sends every problem in one engine call (up to ``EVAL_ROWS`` rows);
* ``qerl eval``: the first ``--limit`` rows, the task's length, ``--device``/``--engine``/``--out``;
* ``qerl train --preset P --steps N`` fits the schedule (and says so); the paper presets run
  without bitsandbytes; gsm8k / math500 by name read the data folder, MATH with its own prompt.
"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from qerl_kit import dense_cache
from qerl_kit.cli import main
from qerl_kit.config import DataConfig, preset
from qerl_kit.data import GSM8K_SUFFIX, MATH_SUFFIX
from qerl_kit.evaluate import EVAL_ROWS, evaluate
from qerl_kit.models import build_model
from qerl_kit.quantize import quantize_model
from qerl_kit.rollout.static import StaticEngine
from qerl_kit.tasks import make_task
from tests.test_evaluate import ScriptedEngine, exact_reward
from tests.test_rollout import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}\n#### {2 * i}"}) + "\n"
                            for i in range(n)))
    return path


# ----------------------------------------------------------------------------- CPU dense-weight cache

@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_cpu_generation_dequantizes_once_per_call_with_identical_tokens(fmt, monkeypatch):
    model = build_model("qwen2-tiny", seed=3, dtype=torch.bfloat16)
    quantize_model(model, fmt=fmt)
    prompts = [[int(t) for t in torch.randint(3, 500, (5 + i,), generator=torch.Generator().manual_seed(i))]
               for i in range(3)]
    from qerl_kit.rollout.types import SamplingParams

    sampling = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = dense_cache.cache_stats()
    cached = StaticEngine(model, None).generate_ids(prompts, 1, sampling)
    after = dense_cache.cache_stats()
    layers = sum(1 for m in model.modules() if type(m).__name__.endswith("Linear") and m is not model.lm_head)
    # each weight dequantized once as a layer (prefill) and once as part of a fused q/k/v or gate/up group
    assert 0 < after["misses"] - before["misses"] <= 2 * layers
    assert after["hits"] - before["hits"] >= 4 * (after["misses"] - before["misses"])  # 11 decode steps reuse them
    import contextlib

    monkeypatch.setattr(dense_cache, "dense_weight_cache", lambda enabled=True: contextlib.nullcontext())
    plain = StaticEngine(model, None).generate_ids(prompts, 1, sampling)
    assert torch.equal(cached.completion_ids, plain.completion_ids)  # the same function, computed once
    assert torch.equal(cached.logprobs, plain.logprobs)
    assert dense_cache._block is None                         # nothing kept between calls


def test_the_cache_keys_on_the_tensor_and_never_outlives_its_block():
    w = torch.randn(8, 4)
    calls = []

    def make():
        calls.append(1)
        return w * 2

    with dense_cache.dense_weight_cache():
        a = dense_cache.cached((w,), torch.float32, make)
        b = dense_cache.cached((w,), torch.float32, make)
        w.add_(1.0)                                            # an in-place change is a new key
        c = dense_cache.cached((w,), torch.float32, make)
        d = dense_cache.cached((w,), torch.bfloat16, make)     # so is another dtype
    assert a is b and len(calls) == 3 and c is not a and d is not c
    dense_cache.cached((w,), torch.float32, make)              # outside a block: computed every time
    assert len(calls) == 4 and dense_cache._block is None


# ----------------------------------------------------------------------------- StaticEngine teardown

def test_a_dropped_engine_state_is_freed_at_once_without_the_cyclic_gc():
    model = build_model("qwen2-tiny", seed=0)
    engine = StaticEngine(model, None, check_every=2)
    from qerl_kit.rollout.types import SamplingParams

    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]]
    # most rows stop early, so live-row compaction makes a view of the state (root <-> view)
    engine.generate_ids(prompts, 2, SamplingParams(max_new_tokens=20, temperature=1.0, seed=0),
                        stop_after=[2, 2, 2, 2, 2, 2, 20, 20])
    state = engine._state[1]
    assert state.views, "the test needs a state with views (compaction)"
    ref = weakref.ref(state)
    del state
    was_on = gc.isenabled()
    gc.disable()
    try:
        engine.generate_ids([[5, 6]], 1, SamplingParams(max_new_tokens=4, temperature=0.0))  # another shape
        assert ref() is None  # freed by reference counting, not left for a GC pass inside a later capture
    finally:
        if was_on:
            gc.enable()


# ----------------------------------------------------------------------------- evaluation batching

def test_evaluation_sends_all_problems_in_one_call_to_an_engine_that_batches_rows():
    tok = make_tokenizer()
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(40)]
    engine = ScriptedEngine()
    engine.batches_rows = True
    evaluate(None, tok, rows, exact_reward, engine=engine, temperature=0.0)
    assert [len(c[0]) for c in engine.calls] == [40]
    engine = ScriptedEngine()
    engine.batches_rows = True
    evaluate(None, tok, rows * 60, exact_reward, engine=engine, samples=8, temperature=1.0)
    assert [len(c[0]) for c in engine.calls] == [EVAL_ROWS // 8] * 9 + [2400 - 9 * (EVAL_ROWS // 8)]
    plain = ScriptedEngine()                                   # transformers' generate pads all rows: chunks
    evaluate(None, tok, rows, exact_reward, engine=plain, temperature=0.0)
    assert max(len(c[0]) for c in plain.calls) < 40


# ----------------------------------------------------------------------------- qerl eval

def test_eval_scores_the_first_limit_rows_with_the_tasks_length_and_writes_json(tmp_path, capsys, monkeypatch):
    data = _jsonl(tmp_path / "mine.jsonl", 12)
    seen = {}
    import qerl_kit.evaluate

    real = qerl_kit.evaluate.evaluate_task

    def spy(task, model, tok, rows=None, **kw):
        seen.update(rows=rows, **kw)
        return real(task, model, tok, rows, **kw)

    monkeypatch.setattr(qerl_kit.evaluate, "evaluate_task", spy)
    out = tmp_path / "res.json"
    assert main(["eval", "--dataset", str(data), "--limit", "3", "--format", "none", "--device", "cpu",
                 "--engine", "static", "--max-new-tokens", "8", "--out", str(out)]) == 0
    assert [r["prompt"] for r in seen["rows"]] == [f"What is {i} plus {i}?" for i in range(3)]  # the first rows
    assert seen["max_new_tokens"] == 8 and type(seen["engine"]).__name__ == "StaticEngine"
    printed = capsys.readouterr().out
    assert "3 mine problems, 8 new tokens, cpu, engine StaticEngine" in printed and "truncated" in printed
    saved = json.loads(out.read_text())
    assert saved["num_problems"] == 3 and saved["meta"]["engine"] == "StaticEngine"
    assert len(saved["per_problem"]) == 3 and "completions" in saved["per_problem"][0]
    assert main(["eval", "--limit", "2", "--engine", "hf"]) == 0          # no --max-new-tokens: the task's
    assert seen["max_new_tokens"] == 64 and type(seen["engine"]).__name__ == "HFEngine"


def test_eval_refuses_bad_inputs_before_loading_anything(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf" in capsys.readouterr().err
    assert main(["eval", "--limit", "0"]) == 2
    err = capsys.readouterr().err
    assert "--limit must be an int in [1, 1000000]" in err and "got 0" in err
    if not torch.cuda.is_available():
        assert main(["eval", "--device", "cuda"]) == 2
        assert "--device cuda: no CUDA device" in capsys.readouterr().err


# ----------------------------------------------------------------------------- train presets

def test_steps_on_a_preset_fits_the_schedule_and_says_so(tmp_path, capsys, monkeypatch):
    seen = {}
    import qerl_kit.trainer

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, policy, tokenizer, task, cfg, **kwargs):
            seen["cfg"] = cfg
            raise Stop

    monkeypatch.setattr(qerl_kit.trainer, "Trainer", Recorder)
    with pytest.raises(Stop):
        main(["train", "--preset", "tiny-cpu", "--steps", "6", "--output-dir", str(tmp_path / "a"), "--no-widgets"])
    assert seen["cfg"].total_steps == 6 and seen["cfg"].aqn.stages == 6
    assert "span 6 steps instead of its total_steps 30" in capsys.readouterr().out
    with pytest.raises(Stop):
        main(["train", "--preset", "tiny-cpu", "--steps", "6", "--keep-schedule", "--output-dir", str(tmp_path / "b"),
              "--no-widgets"])
    assert seen["cfg"].total_steps == 30
    with pytest.raises(Stop):
        main(["train", "--preset", "tiny-cpu", "--steps", "2", "--output-dir", str(tmp_path / "c"), "--no-widgets"])
    assert seen["cfg"].total_steps == 30 and "shorter than AQN's 3 stages" in capsys.readouterr().out


def test_train_refuses_a_missing_model_before_loading_data(tmp_path, capsys):
    assert main(["train", "--preset", "tiny-cpu", "--model", str(tmp_path / "missing.gguf"),
                 "--output-dir", str(tmp_path / "r"), "--no-widgets"]) == 2
    assert "missing.gguf" in capsys.readouterr().err


def test_paper_presets_need_no_bitsandbytes_and_real_gsm8k_points_at_the_fetched_model():
    for name in ("paper-gsm8k", "paper-bigmath"):
        assert preset(name).optim.optimizer == "adamw"
    cfg = preset("real-gsm8k")
    assert cfg.model.name.endswith("qwen2.5-coder-0.5b-instruct.gguf") and cfg.data.dataset == "gsm8k"
    assert cfg.rollout.batch_size == 64 and cfg.rollout.max_new_tokens == 256


# ----------------------------------------------------------------------------- tasks on local data

@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").is_file(), reason=f"shared data {DATA} not found")
def test_gsm8k_and_math500_by_name_read_the_data_folder_with_their_own_prompts(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # the hub is never asked
    monkeypatch.setenv("QERL_DATA", str(DATA))
    tok = make_tokenizer(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    gsm = make_task(DataConfig(dataset="gsm8k", eval_size=5))
    assert len(gsm.train) == 7473 and len(gsm.eval) == 5 and gsm.eval[0]["prompt"].startswith("Janet")
    assert gsm.prompt(tok, gsm.eval[0]).endswith(GSM8K_SUFFIX) and gsm.max_new_tokens == 512
    assert gsm.info["test"].endswith("gsm8k_test.jsonl")
    math = make_task(DataConfig(dataset="math500", eval_size=4))
    assert len(math.eval) == 4 and math.prompt(tok, math.eval[0]).endswith(MATH_SUFFIX)
    assert math.accuracy(completions=["so \\boxed{" + math.eval[0]["answer"] + "}"],
                         answer=[math.eval[0]["answer"]]) == [1.0]


def test_a_missing_data_folder_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QERL_DATA", str(tmp_path))
    assert main(["eval", "--dataset", "gsm8k", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "gsm8k_test.jsonl" in err and "QERL_DATA" in err  # evaluation needs only the test split
