"""Tasks: the arithmetic task's prompts and splits, one prompt everywhere (demo, train, eval), a
JSONL task, the registry, validation; build_policy on a device and dtype; QuantLinear.weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_kit.config import DataConfig, ModelConfig, from_dict
from qerl_kit.data import GSM8K_SUFFIX, build_prompt, load_gsm8k
from qerl_kit.evaluate import evaluate_task
from qerl_kit.rewards import gsm8k_reward
from qerl_kit.tasks import TASKS, Task, arith_prompt, make_task, register_task
from tests.test_rollout import make_tokenizer

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[a]{% endif %}"


def test_the_arithmetic_task_rows_prompts_and_reward():
    task = make_task(DataConfig(train_size=50, eval_size=10))
    assert task.name == "arith" and len(task.train) == 50 and len(task.eval) == 10
    assert {r["prompt"] for r in task.train}.isdisjoint(r["prompt"] for r in task.eval)
    assert task.rewards == (gsm8k_reward,) and task.accuracy is gsm8k_reward and task.prompt_fn is arith_prompt
    tok = make_tokenizer(chat_template=TEMPLATE)
    row = task.eval[0]
    assert task.prompt(tok, row) == build_prompt(tok, row["prompt"], suffix="") and GSM8K_SUFFIX not in task.prompt(tok, row)
    prompts = task.encode(tok, task.eval[:3])
    assert prompts.texts == tuple(task.prompt(tok, r) for r in task.eval[:3])
    assert prompts.ids[0] == tuple(tok(prompts.texts[0], add_special_tokens=False)["input_ids"])
    assert make_task(DataConfig(train_size=50, eval_size=10)).eval == task.eval  # seeded: the same problems


def _captured_task(monkeypatch, run):
    """The Task a command hands the Trainer (the Trainer replaced by a recorder)."""
    import qerl_kit.trainer

    class Stop(Exception):
        pass

    seen = {}

    class Recorder:
        def __init__(self, policy, tokenizer, task, cfg, **kwargs):
            seen.update(task=task, tokenizer=tokenizer)
            raise Stop

    monkeypatch.setattr(qerl_kit.trainer, "Trainer", Recorder)
    with pytest.raises(Stop):
        run()
    return seen["task"], seen["tokenizer"]


def test_demo_train_and_eval_prompt_the_tiny_model_the_same_way(monkeypatch, tmp_path):
    import qerl_kit.tasks
    from qerl_kit.cli import main
    from qerl_kit.demo import run_demo

    demo_task, tok = _captured_task(monkeypatch, lambda: run_demo(steps=3, output_dir=str(tmp_path / "d"),
                                                                  eval_size=4, progress="none"))
    train_task, _ = _captured_task(monkeypatch, lambda: main(["train", "--preset", "tiny-cpu", "--output-dir",
                                                              str(tmp_path / "t"), "--no-widgets"]))
    evaluated = {}
    import qerl_kit.evaluate
    from qerl_kit.evaluate import EvalResult

    def fake_evaluate(task, model, tok, rows=None, **kw):
        evaluated.setdefault("task", task)
        return EvalResult(accuracy=0.0, per_problem=[{"index": 0, "prompt": "p", "answer": "1", "completions": ["c"],
                                                       "pass_rate": 0.0, "finish_reasons": ["stop"]}],
                          samples=1, mean_length=1.0)

    monkeypatch.setattr(qerl_kit.evaluate, "evaluate_task", fake_evaluate)
    assert main(["eval", "--limit", "4"]) == 0
    row = demo_task.eval[0]
    assert demo_task.prompt(tok, row) == train_task.prompt(tok, row) == evaluated["task"].prompt(tok, row)
    assert demo_task.prompt_fn is train_task.prompt_fn is evaluated["task"].prompt_fn is qerl_kit.tasks.arith_prompt


@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").is_file(), reason=f"shared data {DATA} not found")
def test_a_jsonl_task_uses_gsm8k_prompts_and_its_first_rows_as_eval():
    task = make_task(DataConfig(dataset=str(DATA / "gsm8k_test.jsonl"), eval_size=5))
    everything = load_gsm8k(DATA / "gsm8k_test.jsonl")
    assert task.name == "gsm8k_test" and task.eval == everything[:5] and task.train == everything[5:]  # never trained on
    assert task.eval[0]["prompt"].startswith("Janet")  # the file's first problem
    assert task.prompt(None, task.eval[0]).endswith("\nAnswer:") and GSM8K_SUFFIX in task.prompt(None, task.eval[0])
    with pytest.raises(FileNotFoundError, match="no such file"):
        make_task(DataConfig(dataset="missing.jsonl"))


def test_a_registered_task_is_a_config_value_and_make_task_builds_it(monkeypatch):
    rows = [{"prompt": "2+2", "answer": "4"}]
    monkeypatch.setitem(TASKS, "placeholder", None)  # restored after the test
    register_task("placeholder", lambda cfg, seed: Task("placeholder", rows * cfg.eval_size, rows, (gsm8k_reward,)))
    cfg = from_dict(dict(data=dict(dataset="placeholder", eval_size=3)))
    task = make_task(cfg.data)
    assert len(task.train) == 3 and task.prompt(None, rows[0]).startswith("Question: 2+2")
    with pytest.raises(ValueError, match="task name"):
        register_task("x.jsonl", lambda cfg, seed: None)


def test_task_validation_names_the_problem():
    with pytest.raises(ValueError, match="at least one reward"):
        Task("t", [{"prompt": "q"}], [], ())
    with pytest.raises(ValueError, match=r"train rows \[1\] have no 'prompt'"):
        Task("t", [{"prompt": "q"}, {"question": "q"}], [], (gsm8k_reward,))
    with pytest.raises(TypeError, match="prompt_fn must be callable"):
        Task("t", [{"prompt": "q"}], [], (gsm8k_reward,), prompt_fn="q")
    bad = Task("t", [{"prompt": "q"}], [], (gsm8k_reward,), prompt_fn=lambda tok, row: 3)
    with pytest.raises(TypeError, match="returned int, not the prompt text"):
        bad.prompt(None, {"prompt": "q"})
    with pytest.raises(ValueError, match="no held-out rows"):
        evaluate_task(bad, None, None)
    with pytest.raises(TypeError, match="takes a qerl_kit.tasks.Task first"):
        evaluate_task([{"prompt": "q"}], None, None)


def test_build_policy_loads_on_the_device_in_the_dtype():
    from qerl_kit.build import build_policy
    from qerl_kit.linear import NVFP4Linear

    policy, tok, report = build_policy(ModelConfig(lora_r=4), device="cpu", dtype=torch.bfloat16, seed=1)
    base = policy.get_base_model()
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16 and report is not None
    layers = [m for m in base.modules() if isinstance(m, NVFP4Linear)]
    assert layers and all(m.compute_dtype == torch.bfloat16 for m in layers)
    again, _, _ = build_policy(ModelConfig(lora_r=4), device="cpu", dtype=torch.bfloat16, seed=1)
    lora_a = lambda m: {n: p for n, p in m.named_parameters() if "lora_A" in n}  # noqa: E731
    assert all(torch.equal(p, lora_a(again)[n]) for n, p in lora_a(policy).items())  # seeded
    dense, _, none = build_policy(ModelConfig(format="none", lora_r=4))
    assert none is None and dense.get_base_model().model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="architecture preset"):
        build_policy(ModelConfig(name="qwen2-tiny"))


def test_a_quantized_layer_has_no_dense_weight_to_misuse():
    from qerl_kit.linear import NVFP4Linear

    layer = NVFP4Linear.from_linear(torch.nn.Linear(64, 32))
    with pytest.raises(AttributeError, match=r"no dense \.weight; use dequantized_weight\(\)"):
        layer.weight @ torch.randn(64)
    assert not hasattr(layer, "weight") and layer.qweight is layer.packed
    assert layer.dequantized_weight(torch.float32).shape == (32, 64)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        layer.nothing
