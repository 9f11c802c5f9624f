"""The paper's claim, tested: a grid of configurations x seeds on one task, with its metrics.

QeRL claims that quantization noise raises policy entropy, which speeds up reward growth, and that
AQN adds to it. ``run_grid`` trains every configuration of a grid (``STANDARD_GRID``: bf16-LoRA,
NF4-LoRA, MXFP4-LoRA, NVFP4-LoRA, NVFP4-LoRA + AQN and the ablation the paper lacks, bf16-LoRA +
AQN) with several seeds, everything else equal: the same task and held-out problems (data seed 0),
the same prompts and sampling seeds per step for a given seed, the same AQN schedule where it is
on; only the learning rate follows the paper's practice (bf16 lower). It returns two pandas
DataFrames, per-step metrics (long format) and a per-run summary, and writes them as CSV. Each
finished run is also kept as two small CSVs under ``output_dir/runs/``, so a crashed grid resumes
where it stopped. ``plot_curves``, ``plot_summary`` and ``summary_table`` (``qerl_kit.experiment_views``,
re-exported here) draw and tabulate them.

    python -m qerl_kit.experiments --grid reduced --seeds 0 1 2 --out runs/experiments
    python -m qerl_kit.experiments --grid full --device cuda --out runs/experiments-gpu

The output directory is the grid's own: new, empty, or an earlier grid (``.qerl_grid.json``, the
list of files the grid wrote, or the layout of a grid made before that marker existed). A file the
grid did not write is never overwritten or deleted: a foreign non-empty directory, or a foreign
file where the grid would write, raises ``RefusedToOverwrite`` before any training. A directory
under the project's committed results (``bench/results/``, ``lab/results/``) is refused unless
``allow_results=True`` (``--allow-results``).

Two entropies are recorded per step: ``entropy`` (the trainer's, TRL's: exact mean entropy of the
clean training policy over the completion tokens) and ``rollout_nll`` (mean negative log-prob of
the sampled tokens under the policy that sampled them, noisy when AQN is on: at temperature 1 a
Monte-Carlo estimate of the *sampling* policy's entropy, the exploration AQN is meant to add).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from qerl_kit.config import PRESETS
# the views are re-exported: ex.plot_curves, ex.summary_table ... as notebooks call them
from qerl_kit.experiment_views import curve_metrics, markdown_table, plot_curves, plot_summary, summary_table  # noqa: F401
from qerl_kit.formats import DENSE, format_names
from qerl_kit.grid_dir import CLI_OUTPUTS, GRID_OUTPUTS, _GridDir

# Paper Table 4 and the released scripts: lr 1e-5 for QeRL (NVFP4) and QLoRA (NF4), 5e-6 for
# bf16 LoRA ("cannot be larger than 5e-6 or it collapses late"); the reference note, section 5.
BF16_LR_RATIO = 0.5
PAPER_LR = 1e-5
TINY_LR = PRESETS["tiny-cpu"]["optim"]["lr"]  # 2e-3: the tiny task's 4-bit lr; bf16 gets 1e-3
METRIC_COLUMNS = ("reward", "accuracy", "entropy", "rollout_nll", "reward_std", "frac_reward_zero_std",
                  "completions/mean_length", "clip_ratio/region_mean", "aqn/sigma", "lr", "grad_norm",
                  "update/skipped", "time/step", "eval/accuracy")


@dataclass(frozen=True)
class GridConfig:
    """One grid entry: a weight format (``none`` = bf16 weights), AQN on or off, a learning rate."""
    name: str
    format: str
    aqn: bool
    lr: float
    title: str | None = None  # the label in tables and plots; None: from format and AQN

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"config name {self.name!r} must be non-empty letters, digits, '-', '_' or '.'")
        if self.format not in format_names():  # formats.FORMATS, read now, and none (bf16 weights)
            raise ValueError(f"config {self.name!r}: format must be one of {format_names()}; got {self.format!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"config {self.name!r}: lr must be > 0; got {self.lr!r}")

    @property
    def label(self) -> str:
        if self.title:
            return self.title
        base = ("bf16" if self.format == DENSE else self.format.upper()) + "-LoRA"
        return base + (" + AQN" if self.aqn else "")


def standard_grid(base_lr: float = TINY_LR) -> tuple[GridConfig, ...]:
    """The six configurations; the 4-bit ones train at ``base_lr``, bf16 at ``BF16_LR_RATIO`` of it."""
    bf16_lr = base_lr * BF16_LR_RATIO
    return (GridConfig("bf16-lora", "none", False, bf16_lr),
            GridConfig("nf4-lora", "nf4", False, base_lr),
            GridConfig("mxfp4-lora", "mxfp4", False, base_lr),
            GridConfig("nvfp4-lora", "nvfp4", False, base_lr),
            GridConfig("nvfp4-lora-aqn", "nvfp4", True, base_lr),
            GridConfig("bf16-lora-aqn", "none", True, bf16_lr))


def lr_control(base_lr: float = TINY_LR) -> GridConfig:
    """bf16-LoRA at the 4-bit lr: the paper's lr rule changes two things at once (weights and lr);
    this control tells the lr's share of a reward difference from the quantization's."""
    return GridConfig("bf16-lora-4bit-lr", "none", False, base_lr, title="bf16-LoRA, 4-bit lr")


STANDARD_GRID = standard_grid()


@dataclass(frozen=True)
class Budget:
    """How much each run trains and how it is measured (the same for every configuration)."""
    steps: int
    batch_size: int  # completions per step = prompts x group_size
    group_size: int
    eval_size: int  # held-out problems, greedy
    seeds: tuple[int, ...]
    max_new_tokens: int = 64
    eval_every: int = 0  # held-out greedy accuracy every this many steps too (0: at the start and end only)


# name -> (configuration names, budget). "reduced" fits a 2-core CPU (seven configs x 3 seeds in
# about 35 minutes on one thread); "full" is the GPU run; "smoke" is for CI and notebook smoke runs.
GRIDS: dict[str, tuple[tuple[str, ...], Budget]] = {
    "smoke": (("nvfp4-lora", "bf16-lora"), Budget(steps=2, batch_size=8, group_size=4, eval_size=8, seeds=(0,))),
    "reduced": (tuple(c.name for c in STANDARD_GRID) + (lr_control().name,), Budget(30, 32, 8, 200, (0, 1, 2))),
    "full": (tuple(c.name for c in STANDARD_GRID) + (lr_control().name,), Budget(60, 64, 8, 400, (0, 1, 2, 3, 4))),
}


def resolve_configs(configs: Sequence[GridConfig | str], base_lr: float = TINY_LR) -> list[GridConfig]:
    """Names (of ``standard_grid(base_lr)`` and ``lr_control``) or GridConfigs -> GridConfigs."""
    if isinstance(configs, (str, GridConfig)) or not configs:
        raise ValueError("configs must be a non-empty list of GridConfig or names of "
                         f"{[c.name for c in STANDARD_GRID]}")
    known = {c.name: c for c in (*standard_grid(base_lr), lr_control(base_lr))}
    unknown = [c for c in configs if isinstance(c, str) and c not in known]
    if unknown:
        raise ValueError(f"unknown config {unknown[0]!r}; known: {sorted(known)}")
    if any(not isinstance(c, (str, GridConfig)) for c in configs):
        raise TypeError(f"configs must hold GridConfig or str; got {[type(c).__name__ for c in configs]}")
    out = [known[c] if isinstance(c, str) else c for c in configs]
    names = [c.name for c in out]
    if len(set(names)) < len(names):
        raise ValueError(f"duplicate config name(s): {sorted({n for n in names if names.count(n) > 1})}")
    return out


def _check_seeds(seeds: Sequence[int]) -> list[int]:
    if isinstance(seeds, int) or not seeds:
        raise ValueError("seeds must be a non-empty list of ints, e.g. [0, 1, 2]")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds) or len(set(seeds)) < len(seeds):
        raise ValueError(f"seeds must be distinct non-negative ints; got {list(seeds)}")
    return list(seeds)


def _device(device: str) -> torch.device:
    try:  # torch's own message for "gpu" lists twenty device types and is a traceback from main()
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device must be auto, cpu or cuda[:N] with a CUDA GPU present; got {device!r}")
    return dev


def train_config(gc: GridConfig, seed: int, budget: Budget, *, model: str = "tiny", dataset: str = "arith",
                 output_dir: str = "runs/experiments"):
    """The TrainConfig of one run: the ``tiny-cpu`` recipe with the grid entry and the budget."""
    from qerl_kit.config import preset

    if gc.aqn and budget.steps < 3:
        raise ValueError(f"config {gc.name!r} has AQN, which needs at least 3 steps (a noise-free stage 0 "
                         f"and two noisy ones); got steps={budget.steps}")
    return preset("tiny-cpu", model=dict(name=model, format=gc.format),
                  data=dict(dataset=dataset, eval_size=budget.eval_size),
                  rollout=dict(batch_size=budget.batch_size, group_size=budget.group_size,
                               max_new_tokens=budget.max_new_tokens),
                  loss=dict(micro_batch=min(budget.batch_size, 64)), optim=dict(lr=gc.lr),
                  aqn=dict(enabled=gc.aqn, stages=min(10, budget.steps)),
                  total_steps=budget.steps, seed=seed, save_every=0, eval_every=0, output_dir=output_dir)


class _RecordingEngine:
    """Wraps a rollout engine and records the mean negative log-prob of the tokens it samples."""

    def __init__(self, engine):
        self.engine, self.nll = engine, []

    def generate(self, prompts, n, sampling):
        out = self.engine.generate(prompts, n, sampling)
        mask = out.completion_mask.float()
        self.nll.append(float(-(out.logprobs.float() * mask).sum() / mask.sum().clamp(min=1)))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def run_one(gc: GridConfig, seed: int, cfg, data, device: torch.device, base_cache: dict,
            progress: str = "none", eval_every: int = 0) -> tuple[list[dict], dict]:
    """Train one (config, seed); returns (per-step rows, summary). ``data`` = the Task (make_task(cfg.data)).
    ``eval_every`` > 0 also records held-out greedy accuracy every that many steps (``eval/accuracy``)."""
    from qerl_kit.build import build_policy
    from qerl_kit.rollout import make_engine
    from qerl_kit.trainer import Trainer

    start = time.perf_counter()
    torch.manual_seed(seed)
    # bf16 compute on the GPU, as in the paper; float32 (exact) on the CPU
    policy, tok, _ = build_policy(cfg.model, device=device, dtype=torch.bfloat16 if device.type == "cuda" else None,
                                  seed=seed)
    task, heldout = data, data.eval
    engine = _RecordingEngine(make_engine(cfg.rollout.engine, policy, tok))  # auto: StaticEngine on a GPU
    trainer = Trainer(policy, tok, task, cfg, engine=engine, progress=progress)
    # LoRA's B starts at zero, so the untrained policy is the base model: its greedy accuracy is the
    # same for every seed and with or without AQN (noise is only on during rollouts); measure once.
    key = (cfg.model.name, cfg.model.format)
    if key not in base_cache:
        base_cache[key] = trainer.evaluate(batch_size=64).accuracy
    engine.nll.clear()

    def record(row: dict) -> None:  # the row is the dict kept in trainer.history
        row["rollout_nll"] = sum(engine.nll) / len(engine.nll) if engine.nll else float("nan")
        if eval_every and row["step"] % eval_every == 0:  # greedy, seeded: the training RNG is untouched
            row["eval/accuracy"] = trainer.evaluate(batch_size=64).accuracy
        engine.nll.clear()  # after the evaluation too: its greedy tokens are not the rollout's

    trainer.train(callback=record)
    last_row = trainer.history[-1] if trainer.history else {}
    final = last_row["eval/accuracy"] if "eval/accuracy" in last_row else trainer.evaluate(batch_size=64).accuracy
    wall = time.perf_counter() - start
    rows = [{"config": gc.name, "label": gc.label, "seed": seed, "step": int(r["step"]),
             **{m: float(r.get(m, 0.0 if m == "aqn/sigma" else math.nan)) for m in METRIC_COLUMNS}}
            for r in trainer.history]
    last = rows[-min(5, len(rows)):]
    summary = {"config": gc.name, "label": gc.label, "seed": seed, "format": gc.format, "aqn": gc.aqn, "lr": gc.lr,
               "steps": cfg.total_steps, "batch_size": cfg.rollout.batch_size, "group_size": cfg.rollout.group_size,
               "eval_size": len(heldout), "max_new_tokens": cfg.rollout.max_new_tokens, "eval_every": eval_every,
               "model": cfg.model.name,
               "dataset": cfg.data.dataset, "base_accuracy": base_cache[key], "final_accuracy": final,
               "initial_entropy": rows[0]["entropy"], "mean_entropy": _mean(r["entropy"] for r in rows),
               "initial_rollout_nll": rows[0]["rollout_nll"], "mean_rollout_nll": _mean(r["rollout_nll"] for r in rows),
               "initial_reward": rows[0]["reward"], "mean_reward": _mean(r["reward"] for r in rows),
               "final_reward": _mean(r["reward"] for r in last), "wall_seconds": wall,
               "seconds_per_step": _mean(r["time/step"] for r in rows), "device": str(device),
               "threads": torch.get_num_threads(), "torch": torch.__version__}
    return rows, summary


def _same(recorded, wanted) -> bool:
    if isinstance(wanted, float) and isinstance(recorded, (int, float)):
        return math.isclose(recorded, wanted, rel_tol=1e-9)
    return recorded == wanted


def _mean(values) -> float:
    return float(sum(values := list(values)) / len(values))


def run_grid(configs: Sequence[GridConfig | str], seeds: Sequence[int], *, steps: int = 30, batch_size: int = 32,
             group_size: int = 8, eval_size: int = 200, max_new_tokens: int = 64,
             output_dir: str | os.PathLike = "runs/experiments", device: str = "auto", model: str = "tiny",
             dataset: str = "arith", progress: str = "none", log: Callable[[str], None] = print,
             allow_results: bool = False, eval_every: int = 0):
    """Train every (config, seed); returns ``(metrics, summary)`` DataFrames, also written as
    ``output_dir/metrics.csv`` and ``output_dir/summary.csv``.

    A run whose ``runs/<config>_seed<k>_summary.csv`` exists is not trained again (its CSVs are
    read back), so calling this again after a crash continues the grid; a finished run recorded
    with other settings (steps, batch, lr ...) is an error rather than a silent mix.

    ``output_dir`` must be new, empty or an earlier grid's (``.qerl_grid.json`` lists the files the
    grid wrote); a file the grid did not write is never overwritten or deleted
    (``qerl_kit.export.RefusedToOverwrite``, raised before any training). Under the project's
    committed results (``bench/results/``, ``lab/results/``) it is refused unless ``allow_results=True``.
    """
    from qerl_kit.tasks import make_task

    base_lr = TINY_LR if model == "tiny" else PAPER_LR
    configs, seeds, dev = resolve_configs(configs, base_lr), _check_seeds(seeds), _device(device)
    if not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"eval_every must be an int >= 0 (0: held-out accuracy at the start and end only); "
                         f"got {eval_every!r}")
    budget = Budget(steps, batch_size, group_size, eval_size, tuple(seeds), max_new_tokens, eval_every)
    out = Path(output_dir)
    runs = out / "runs"
    plan = [(gc, s, train_config(gc, s, budget, model=model, dataset=dataset,  # validates all before training
                                 output_dir=str(runs / ".work" / f"{gc.name}_seed{s}")))
            for s in seeds for gc in configs]  # seed-major: a grid stopped early still has every config
    grid = _GridDir.inspect(out, allow_results=allow_results)
    todo = [f"{gc.name}_seed{s}" for gc, s, _ in plan if not (runs / f"{gc.name}_seed{s}_summary.csv").exists()]
    grid.check(*GRID_OUTPUTS, *(f"runs/{n}{end}" for n in todo for end in
                                ("_metrics.csv", "_summary.csv.tmp", "_summary.csv")))
    grid.create()
    runs.mkdir(parents=True, exist_ok=True)
    data, base_cache, metrics, summaries = None, {}, [], []
    for i, (gc, seed, cfg) in enumerate(plan, 1):
        stem, where = runs / f"{gc.name}_seed{seed}", f"[{i}/{len(plan)}] {gc.name} seed {seed}"
        if Path(f"{stem}_summary.csv").exists():
            frame, summary = _finished_run(stem, gc, budget, model, dataset)
            log(f"{where}: finished earlier, read {stem.name}_summary.csv")
        else:
            if data is None:
                data = make_task(cfg.data)  # seed 0: the same problems for every run
            log(f"{where}: training {steps} steps ({gc.label}, lr {gc.lr:g}) ...")
            frame, summary = _train_run(grid, stem, gc, seed, cfg, data, dev, base_cache, progress, eval_every)
            log(f"    base {summary['base_accuracy']:.3f} -> final {summary['final_accuracy']:.3f}, initial entropy "
                f"{summary['initial_entropy']:.4f}, mean reward {summary['mean_reward']:.3f}, "
                f"{summary['wall_seconds']:.0f} s")
        metrics.append(frame)
        summaries.append(summary)
    shutil.rmtree(runs / ".work", ignore_errors=True)
    return _grid_tables(grid, configs, metrics, summaries)


def _finished_run(stem: Path, gc: GridConfig, budget: Budget, model: str, dataset: str):
    """(metrics, summary) of a run a previous call finished, read back; recorded with other settings
    than these is an error rather than a silent mix."""
    import pandas as pd

    done = Path(f"{stem}_summary.csv")
    summary = pd.read_csv(done).iloc[0].to_dict()
    want = dict(format=gc.format, aqn=gc.aqn, lr=gc.lr, steps=budget.steps, batch_size=budget.batch_size,
                group_size=budget.group_size, eval_size=budget.eval_size, max_new_tokens=budget.max_new_tokens,
                model=model, dataset=dataset, eval_every=budget.eval_every)
    summary.setdefault("eval_every", 0)  # runs recorded before eval_every existed evaluated start and end only
    diff = {k: (summary.get(k), v) for k, v in want.items() if not _same(summary.get(k), v)}
    if diff:
        raise ValueError(f"{done} was recorded with other settings (recorded, asked): {diff}; "
                         "use another output_dir or delete it")
    return pd.read_csv(f"{stem}_metrics.csv"), summary


def _train_run(grid: _GridDir, stem: Path, gc: GridConfig, seed: int, cfg, data, dev: torch.device,
               base_cache: dict, progress: str, eval_every: int):
    """Train one run (``run_one``) and write its two CSVs, the summary last and atomically (its
    presence means the run finished); returns (metrics DataFrame, summary)."""
    import pandas as pd

    work = Path(cfg.output_dir)  # runs/.work/<run>: the trainer's scratch directory, the grid's own
    shutil.rmtree(work, ignore_errors=True)  # a crashed run's partial metrics.jsonl
    rows, summary = run_one(gc, seed, cfg, data, dev, base_cache, progress=progress, eval_every=eval_every)
    shutil.rmtree(work, ignore_errors=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(grid.claim(f"runs/{stem.name}_metrics.csv"), index=False)
    tmp = grid.claim(f"runs/{stem.name}_summary.csv.tmp")
    pd.DataFrame([summary]).to_csv(tmp, index=False)
    tmp.replace(grid.claim(f"runs/{stem.name}_summary.csv"))
    return frame, summary


def _grid_tables(grid: _GridDir, configs: list[GridConfig], metrics: list, summaries: list[dict]):
    """The grid's (metrics, summary) DataFrames in grid order, seeds ascending, written as CSV."""
    import pandas as pd

    rank = {gc.name: i for i, gc in enumerate(configs)}
    key = lambda col: col.map(rank) if col.name == "config" else col  # noqa: E731
    metrics_df = pd.concat(metrics).sort_values(["config", "seed", "step"], key=key, ignore_index=True)
    summary_df = pd.DataFrame(summaries).sort_values(["config", "seed"], key=key, ignore_index=True)
    metrics_df.to_csv(grid.claim("metrics.csv"), index=False)
    summary_df.to_csv(grid.claim("summary.csv"), index=False)
    return metrics_df, summary_df


# ---- command line ------------------------------------------------------------------------------
def _task_budget(dataset: str) -> int:
    """The completion budget of a registered task (countdown 96; GSM8K, MATH-500 512); 512 for a
    .jsonl path or a task that names none (real tasks reason longer than the tiny arithmetic)."""
    from qerl_kit.config import DataConfig
    from qerl_kit.tasks import make_task

    if dataset.endswith(".jsonl"):
        return 512
    try:  # generated tasks build in milliseconds; a data file that is missing here fails in run_grid, loudly
        return make_task(DataConfig(dataset=dataset, train_size=1, eval_size=1)).max_new_tokens or 512
    except (ImportError, OSError):
        return 512


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m qerl_kit.experiments", description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="reduced",
                   help="configurations and budget: reduced (CPU), full (GPU), smoke")
    p.add_argument("--configs", nargs="+", help="a subset of the grid's configurations, by name")
    p.add_argument("--seeds", nargs="+", type=int, help="default: the grid's")
    for opt in ("--steps", "--batch-size", "--group-size", "--eval-size", "--eval-every"):
        p.add_argument(opt, type=int, help="default: the grid's budget")
    p.add_argument("--lr", type=float, default=None,
                   help="the 4-bit configurations' learning rate (bf16 gets half, its control this one); "
                        f"default {TINY_LR:g} for the tiny model, the paper's {PAPER_LR:g} for any other")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--model", default="tiny", help="tiny or a local Hugging Face directory")
    p.add_argument("--dataset", default="arith")
    p.add_argument("--out", default="runs/experiments",
                   help="output directory: new, empty or an earlier grid's (finished runs in it are reused); "
                        "files the grid did not write are never overwritten")
    p.add_argument("--allow-results", action="store_true",
                   help="allow an output directory under the project's committed results (bench/results/, "
                        "lab/results/)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    names, budget = GRIDS[args.grid]
    from qerl_kit.export import RefusedToOverwrite

    try:  # a flag's value refused anywhere below (ConfigError is a ValueError) is a usage error: one line, rc 2
        dev = _device(args.device)
        if dev.type == "cpu":  # one thread: the tiny model gains nothing from more, and they fight (demo.py)
            from qerl_kit.threads import set_cpu_threads

            set_cpu_threads()
        kw = {k: getattr(budget, k) if getattr(args, k) is None else getattr(args, k)
              for k in ("steps", "batch_size", "group_size", "eval_size", "eval_every")}
        kw["max_new_tokens"] = budget.max_new_tokens if args.dataset == "arith" else _task_budget(args.dataset)
        _GridDir.inspect(args.out, allow_results=args.allow_results).check(*CLI_OUTPUTS)  # before any training
        configs = args.configs or names  # names: run_grid picks the learning rate by model
        if args.lr is not None:
            if not args.lr > 0:
                raise ValueError(f"--lr must be > 0; got {args.lr}")
            configs = resolve_configs(configs, base_lr=args.lr)
        metrics, summary = run_grid(configs, args.seeds or budget.seeds, output_dir=args.out,
                                    device=args.device, model=args.model, dataset=args.dataset,
                                    allow_results=args.allow_results, **kw)
        grid = _GridDir.inspect(args.out, allow_results=args.allow_results)
        grid.check(*CLI_OUTPUTS)
    except (ValueError, TypeError, RefusedToOverwrite) as err:
        p.error(str(err))
    resolved = {**kw, "device": str(dev), "model": args.model, "dataset": args.dataset}
    _write_views(grid, metrics, summary, resolved, argv)
    print(f"\n\nwrote {Path(args.out)}/metrics.csv, summary.csv, curves.png, curves_smoothed.png, "
          "summary.png, table.md, command.json")
    return 0


def _write_views(grid: _GridDir, metrics, summary, resolved: dict, argv: Sequence[str] | None) -> None:
    """The grid's plots, ``table.md`` (also printed) and ``command.json`` (the command, what it resolved
    to and the machine), each claimed in the grid directory."""
    import platform
    import shlex
    import sys

    plot_curves(metrics).savefig(grid.claim("curves.png"), dpi=110)
    plot_curves(metrics, curve_metrics(metrics), smooth=5).savefig(grid.claim("curves_smoothed.png"), dpi=110)
    plot_summary(summary).savefig(grid.claim("summary.png"), dpi=110)
    table = markdown_table(summary_table(summary))
    grid.claim("table.md").write_text(table + "\n")
    grid.claim("command.json").write_text(json.dumps({
        "command": "python -m qerl_kit.experiments " + shlex.join(sys.argv[1:] if argv is None else argv),
        "resolved": {"configs": list(summary["config"].unique()), "seeds": sorted(summary["seed"].unique().tolist()),
                     **resolved},
        "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2) + "\n")
    print("\n" + table, end="")


if __name__ == "__main__":
    raise SystemExit(main())
