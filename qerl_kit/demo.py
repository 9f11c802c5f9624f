"""The main job: QeRL on the shipped tiny model, end to end, on whatever machine this is.

``qerl demo`` (``./run demo``) loads the tiny base through ``from_pretrained``, quantizes it to
NVFP4, attaches LoRA, turns AQN on and runs GRPO/DAPO (the ``tiny-cpu`` preset) on the synthetic
arithmetic task. It measures the quantized base's held-out greedy accuracy first and the
trained policy's after, with the same decoding, and writes to ``runs/demo/``: ``summary.json``,
``metrics.jsonl``, ``curves.png`` (reward, accuracy and entropy against step) and checkpoints.
``--model DIR --dataset gsm8k`` runs the same job on a real model where a GPU is available.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch


def run_demo(model: str = "tiny", dataset: str = "arith", steps: int | None = None, seed: int = 0,
             output_dir: str = "runs/demo", eval_size: int | None = None, fmt: str = "nvfp4",
             progress: str = "auto") -> dict:
    """Run the demo and return its summary (also written to ``output_dir/summary.json``)."""
    from qerl_kit.build import build_policy
    from qerl_kit.config import save_config
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    start = time.perf_counter()
    cfg = demo_config(model, dataset, steps, seed, output_dir, eval_size, fmt)
    out = Path(output_dir)
    from qerl_kit import runs

    print(f"qerl demo: a new run in {out}" + (f"; the run found there moves to {out / runs.PREVIOUS}/"
                                              if runs.run_files(out) else ""))
    runs.lock(out)  # this process's directory (a second live run is refused) before the model loads
    torch.manual_seed(seed)
    policy, tokenizer, report = build_policy(cfg.model, seed=seed)
    if report is not None:
        print(report.summary())
    task = make_task(cfg.data)  # the same problems for every seed
    trainer = Trainer(policy, tokenizer, task, cfg, progress=progress)
    trainer.claim_output_dir("demo")  # a fresh run each time: an earlier one moves aside, nothing is deleted
    save_config(cfg, out / "config.yaml")
    print(f"held-out split: {len(task.eval)} problems; measuring the quantized base (greedy) ...")
    base = trainer.evaluate(batch_size=64)
    print(f"base accuracy {base.accuracy:.3f}; training {cfg.total_steps} GRPO steps "
          f"({cfg.rollout.batch_size} completions each, AQN {cfg.aqn.sigma_start:g} -> {cfg.aqn.sigma_end:g})")
    trainer.train()
    final = trainer.evaluate(batch_size=64)
    trainer.save()
    wall = time.perf_counter() - start
    _plot_curves(trainer.history, base.accuracy, final.accuracy, fmt, out)
    summary = _summary(trainer, base.accuracy, final.accuracy, wall,
                       dict(seed=seed, model=model, dataset=dataset, format=fmt, eval_problems=len(task.eval)))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_result(summary, fmt, trainer.step, out)
    return summary


def demo_config(model: str, dataset: str, steps: int | None, seed: int, output_dir: str, eval_size: int | None,
                fmt: str):
    """The demo's TrainConfig (the ``tiny-cpu`` preset and the arguments), checked before any loading;
    on a CPU, the thread count the tiny model runs fastest with."""
    from qerl_kit.config import preset
    from qerl_kit.config_types import check_seed, check_steps
    from qerl_kit.models import BASE_NAMES, check_model_source

    if steps is not None:  # the checks every entry point shares, before minutes of loading
        check_steps("steps", steps)
    check_seed("seed", seed, rng=False)  # the config's seed (per-step seeds are derived from it)
    if not torch.cuda.is_available():
        # The tiny model's matmuls are too small to gain from intra-op threads, and extra threads
        # compete with everything else on a small machine (measured: 3x slower with 2 threads
        # on a busy 2-core CPU). QERL_THREADS overrides (checked: qerl_kit.threads).
        from qerl_kit.threads import set_cpu_threads

        set_cpu_threads()
    overrides: dict = dict(model=dict(name=model, format=fmt), data=dict(dataset=dataset), seed=seed,
                           output_dir=output_dir, save_every=10)
    if steps is not None:
        overrides["total_steps"] = steps
        if steps < 10:  # short smoke runs: fewer AQN stages (at least 3), or none below 3 steps
            overrides["aqn"] = dict(stages=steps) if steps >= 3 else dict(enabled=False)
    if dataset != "arith":  # real reasoning needs longer completions than the tiny task
        overrides["rollout"] = dict(max_new_tokens=512)
    if eval_size is not None:
        overrides["data"]["eval_size"] = eval_size
    cfg = preset("tiny-cpu", **overrides)
    check_model_source(model, presets=BASE_NAMES)  # a typo or a missing path fails before anything moves
    return cfg


def _plot_curves(history: list[dict], base: float, final: float, fmt: str, out: Path) -> None:
    """``out/curves.png``: reward, accuracy and entropy against step, held-out accuracy as lines."""
    from qerl_kit.plots import plot_metrics

    fig = plot_metrics(history, ("reward", "accuracy", "entropy"),
                       title=f"QeRL demo ({fmt} + LoRA + AQN): held-out {base:.1%} -> {final:.1%}")
    for ax in fig.axes:
        if ax.get_title() == "accuracy":
            ax.axhline(base, linestyle="--", color="gray", label="held-out, base")
            ax.axhline(final, linestyle="--", color="green", label="held-out, trained")
            ax.legend(fontsize=7)
    fig.savefig(out / "curves.png", dpi=110)


def _summary(trainer, base: float, final: float, wall: float, run: dict) -> dict:
    """What ``summary.json`` holds: accuracies, steps, timing, the run's arguments and the machine."""
    history = trainer.history
    return {
        "base_accuracy": base, "final_accuracy": final, "improvement_points": 100 * (final - base),
        "steps": trainer.step, "wall_seconds": wall, "seed": run["seed"], "model": run["model"],
        "dataset": run["dataset"], "format": run["format"], "eval_problems": run["eval_problems"],
        "decoding": "greedy",
        "mean_seconds": {k: sum(r[k] for r in history) / len(history)
                         for k in ("time/rollout", "time/logprob", "time/update", "time/step")},
        "final_reward": history[-1]["reward"], "machine": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _print_result(summary: dict, fmt: str, steps: int, out: Path) -> None:
    from qerl_kit.table import text_table

    rows = [{"": "quantized base (NVFP4)" if fmt == "nvfp4" else f"base ({fmt})",
             "held-out accuracy": summary["base_accuracy"]},
            {"": f"after {steps} GRPO steps", "held-out accuracy": summary["final_accuracy"]}]
    print("\n" + text_table(rows))
    print(f"\nimprovement: {summary['improvement_points']:+.1f} points in {summary['wall_seconds'] / 60:.1f} min; "
          f"wrote {out / 'summary.json'}, {out / 'curves.png'}, {out / 'metrics.jsonl'}")
