"""Issue #42's GRPO study on a real model: the paper's four bases, several seeds, in parallel on one GPU.

    python -m bench.real_grpo run MODEL --out OUT [--configs ...] [--seeds 0 1 2] [--steps 30] [--parallel 12]
    python -m bench.real_grpo report OUT [--plot]

Each (configuration, seed) is one process (``worker``) running the ``real-gsm8k`` preset
(qerl_kit/config.py: 8 prompts x 8 samples of 256 tokens on GSM8K train, GRPO, mu 1, LoRA r 16)
with the configuration's base format, AQN switch and learning rate, checkpointing every 5 steps
into OUT/<config>_s<seed>: killed or timed out, ``run`` again resumes every run from its last
checkpoint (``Trainer.resume``), and finished runs are skipped. At the end each run evaluates its
adapter greedily on the whole GSM8K test at 512 new tokens (``final.json``). Small models leave an
H200 mostly idle, so the runs share it; seconds per step are therefore not single-run figures.

``report`` reads every run's metrics.jsonl and final.json and writes ``study.md``: per
configuration, mean reward / entropy / completion length over steps with a 95% band across seeds
(t-interval), seconds per step split into rollout and update, peak memory next to the memory plan,
and final accuracy per seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# name -> (base format, AQN on, lr). The paper raises the lr for 4-bit bases (1e-5 against 5e-6 at
# 7B); here every 4-bit base gets twice the bf16 lr.
CONFIGS = {
    "nvfp4-lora-aqn": ("nvfp4", True, 1e-4),
    "nvfp4-lora": ("nvfp4", False, 1e-4),
    "bf16-lora": ("none", False, 5e-5),
    "nf4-lora": ("nf4", False, 1e-4),
}


def worker(model: str, name: str, seed: int, steps: int, run_dir: str) -> None:
    import torch

    from qerl_kit import checkpoint as ckpt
    from qerl_kit.build import build_policy
    from qerl_kit.config import preset
    from qerl_kit.memory_plan import plan_memory
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    fmt, aqn, lr = CONFIGS[name]
    smoke = os.environ.get("QERL_STUDY_SMOKE")  # tiny sizes for a CPU check of this script
    cfg = preset("real-gsm8k", model={"name": model, "format": fmt}, optim={"lr": lr}, aqn={"enabled": aqn, "stages": min(5, max(3, steps))},
                 total_steps=steps, save_every=5, seed=seed, output_dir=run_dir,
                 **({"rollout": {"batch_size": 8, "max_new_tokens": 8}, "data": {"eval_size": 4}} if smoke else {}))
    cuda = torch.cuda.is_available()  # the CPU runs it too (a smoke test)
    policy, tok, _ = build_policy(cfg.model, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else None,
                                  seed=seed)
    trainer = Trainer(policy, tok, make_task(cfg.data), cfg, progress="none")
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None:
        trainer.resume(latest)
    else:
        trainer.claim_output_dir("train")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    while trainer.step < steps:
        trainer.train(min(5, steps - trainer.step))
        trainer.save()
        print(f"{name} seed {seed}: step {trainer.step}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    t0 = time.perf_counter()
    result = trainer.evaluate(max_new_tokens=int(os.environ.get("QERL_STUDY_EVAL_TOKENS", 512)))
    try:
        # the bound of max_memory_allocated (prompts are cut at 256 tokens); tests/data/measured_peaks.json
        plan = plan_memory(policy.config, fmt=fmt, lora_r=cfg.model.lora_r, optimizer=cfg.optim.optimizer,
                           rollout_batch=cfg.rollout.batch_size, group_size=cfg.rollout.group_size, prompt_len=256,
                           max_new_tokens=cfg.rollout.max_new_tokens, micro_batch=cfg.loss.micro_batch,
                           gradient_checkpointing=cfg.model.gradient_checkpointing).allocated / 2**30
    except Exception as err:  # noqa: BLE001 - the plan is a reference figure, not the run's purpose
        plan = f"{type(err).__name__}: {err}"
    Path(run_dir, "final.json").write_text(json.dumps({
        "config": name, "seed": seed, "format": fmt, "aqn": aqn, "lr": lr, "steps": trainer.step,
        "accuracy": result.accuracy, "mean_length": result.mean_length, "truncation_rate": result.truncation_rate,
        "eval_seconds": time.perf_counter() - t0, "peak_gib_train": peak, "plan_gib": plan,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}))
    print(f"{name} seed {seed}: final accuracy {result.accuracy:.4f}", flush=True)


def run(model: str, out: str, configs, seeds, steps: int, parallel: int) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    todo = [(c, s) for c in configs for s in seeds if not Path(out, f"{c}_s{s}", "final.json").exists()]
    procs: list[tuple[subprocess.Popen, str]] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    while todo or procs:
        while todo and len(procs) < parallel:
            c, s = todo.pop(0)
            d = Path(out, f"{c}_s{s}")
            d.mkdir(exist_ok=True)
            log = open(d / "log.txt", "a")
            p = subprocess.Popen([sys.executable, "-m", "bench.real_grpo", "worker", model, c, str(s), str(steps), str(d)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
            procs.append((p, f"{c}_s{s}"))
        time.sleep(5)
        for p, tag in list(procs):
            if p.poll() is not None:
                procs.remove((p, tag))
                print(f"{tag}: exit {p.returncode}", flush=True)


def _band(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% t-interval (0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78}.get(n, 2.0)
    return mean, t * sd / math.sqrt(n)


def report(out: str) -> str:
    runs: dict[str, list[dict]] = {}
    for d in sorted(Path(out).iterdir()):
        if not (d / "metrics.jsonl").exists():
            continue
        hist = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        final = json.loads((d / "final.json").read_text()) if (d / "final.json").exists() else None
        runs.setdefault(d.name.rsplit("_s", 1)[0], []).append({"hist": hist, "final": final, "dir": d.name})
    lines = ["| config | seeds | steps | reward first 5 | reward last 5 | entropy first 5 | entropy last 5 | "
             "length last 5 | s/step (rollout + update) | final GSM8K acc | peak GiB / plan GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    curves = {}
    for name, rs in runs.items():
        def window(key, lo, hi):
            return _band([sum(r[key] for r in h["hist"][lo:hi] if key in r) / max(1, len(h["hist"][lo:hi]))
                          for h in rs if h["hist"]])
        steps = min(len(h["hist"]) for h in rs)
        rf, rl = window("reward", 0, 5), window("reward", steps - 5, steps)
        ef, el = window("entropy", 0, 5), window("entropy", steps - 5, steps)
        ll = window("completions/mean_length", steps - 5, steps)
        t = window("time/step", 1, steps)
        tr = window("time/rollout", 1, steps)
        finals = [h["final"] for h in rs if h["final"]]
        acc = _band([f["accuracy"] for f in finals]) if finals else (float("nan"), 0.0)
        peak = max((f["peak_gib_train"] for f in finals), default=float("nan"))
        plan = finals[0]["plan_gib"] if finals else "n/a"
        plan_s = f"{plan:.2f}" if isinstance(plan, float) else str(plan)[:30]
        seeds_acc = ", ".join(format(f["accuracy"], ".3f") for f in finals)
        lines.append(f"| {name} | {len(rs)} | {steps} | {rf[0]:.3f} ± {rf[1]:.3f} | {rl[0]:.3f} ± {rl[1]:.3f} | "
                     f"{ef[0]:.3f} ± {ef[1]:.3f} | {el[0]:.3f} ± {el[1]:.3f} | {ll[0]:.0f} | {t[0]:.1f} "
                     f"({tr[0]:.1f} + {t[0] - tr[0]:.1f}) | {acc[0]:.4f} ± {acc[1]:.4f} "
                     f"({seeds_acc}) | {peak:.1f} / {plan_s} |")
        curves[name] = {key: [_band([h["hist"][i][key] for h in rs if i < len(h["hist"]) and key in h["hist"][i]])
                              for i in range(steps)] for key in ("reward", "entropy", "completions/mean_length")}
    text = "\n".join(lines) + "\n"
    Path(out, "study.md").write_text(text)
    Path(out, "curves.json").write_text(json.dumps(curves))
    print(text)
    return text


def plot(out: str, path: str | None = None) -> str:
    """Reward, entropy and completion length per step, one line per configuration with its 95% band
    across seeds (from curves.json), saved as a PNG next to it (or at ``path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = json.loads(Path(out, "curves.json").read_text())
    keys = (("reward", "reward (train batch)"), ("entropy", "entropy (nats/token)"),
            ("completions/mean_length", "completion length (tokens)"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label) in zip(axes, keys):
        for name, c in curves.items():
            mean = [m for m, _ in c[key]]
            half = [h for _, h in c[key]]
            steps = range(1, len(mean) + 1)
            ax.plot(steps, mean, label=name)
            ax.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)], alpha=0.15)
        ax.set_xlabel("step")
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("GRPO on Qwen2.5-Coder-0.5B-Instruct, GSM8K train: mean of 3 seeds, 95% band")
    fig.tight_layout()
    target = path or str(Path(out, "curves.png"))
    fig.savefig(target, dpi=90)
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("--out", required=True)
    r.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--parallel", type=int, default=12)
    w = sub.add_parser("worker")
    w.add_argument("model")
    w.add_argument("config", choices=list(CONFIGS))
    w.add_argument("seed", type=int)
    w.add_argument("steps", type=int)
    w.add_argument("run_dir")
    rep = sub.add_parser("report")
    rep.add_argument("out")
    rep.add_argument("--plot", action="store_true", help="also draw curves.png from curves.json")
    a = p.parse_args(argv)
    if a.cmd == "run":
        run(a.model, a.out, a.configs, a.seeds, a.steps, a.parallel)
        report(a.out)
    elif a.cmd == "worker":
        worker(a.model, a.config, a.seed, a.steps, a.run_dir)
    else:
        if (Path(a.out) / "metrics.jsonl").exists() or any(Path(a.out).glob("*/metrics.jsonl")):
            report(a.out)
        if a.plot:
            print(plot(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
