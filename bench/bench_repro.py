"""Is an NVFP4 GRPO step bit-reproducible across processes? N fresh processes, the same seed, compared.

    python -m bench.bench_repro --out bench/results/repro_cpu                  # CPU: the tiny model
    python -m bench.bench_repro --preset real-gsm8k --out OUT                   # GPU: the real 0.5B GGUF
    python -m bench.bench_repro --model tiny --new 64 --processes 3 --out OUT   # GPU: the tiny model

Each process (``--worker``, started by the parent one after the other, so no two time kernels on
one GPU at once) builds the policy of ``--preset`` (``tiny-cpu``: the shipped tiny model on the
arithmetic task; ``real-gsm8k``: the 0.5B GGUF on GSM8K; ``--model`` overrides the model) in
NVFP4 with LoRA, seeds everything with ``--seed``, and runs one Trainer step on ``StaticEngine``
(a rollout of ``--prompts`` x ``--group`` completions of ``--new`` tokens, the old-policy
log-probs, the update). It writes the sha256 of the completion ids, the rollout's sampling
log-probs, the old log-probs and the adapter after the step (every trainable tensor, by name), with
the autotune mode and how many Triton tile choices it timed. All processes share one autotune
cache file (``--cache``, default a fresh one in ``--out``): the first times the kernels and stores
its choices, the others read them (``qerl_kit.kernels.tuning``; ``--autotune pinned`` times
nothing). The parent compares the hashes and writes ``repro.md`` and ``repro.json`` to ``--out``:
the machine, the date, the versions and one row per process; the exit status is 1 when a hash
differs. ``--backend ours`` leaves humming out (``QERL_KERNEL_BACKEND``); ``--torch-deterministic``
turns on torch's deterministic algorithms (``warn_only``, with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``)
and lists the ops of the step that torch has no deterministic kernel for.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

FIELDS = ("completion_ids", "rollout_logprobs", "old_logprobs", "adapter")


def sha(t: torch.Tensor | None) -> str:
    """sha256 of a tensor's bytes (its dtype and shape included), or "n/a"."""
    if t is None:
        return "n/a"
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def adapter_sha(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            h.update(name.encode())
            h.update(sha(p).encode())
    return h.hexdigest()


def build_trainer(args, out_dir: Path):
    """(trainer, policy) of ``args.preset`` on the GPU if there is one: NVFP4, LoRA, StaticEngine."""
    from qerl_kit.build import build_policy
    from qerl_kit.config import preset
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    model = {"format": "nvfp4", **({"name": args.model} if args.model else {})}
    cfg = preset(args.preset, model=model, seed=args.seed, total_steps=10, save_every=0, eval_every=0,
                 output_dir=str(out_dir), rollout=dict(batch_size=args.prompts * args.group, group_size=args.group,
                                                       max_new_tokens=args.new, engine="static",
                                                       temperature=args.temperature),
                 loss=dict(micro_batch=args.prompts * args.group))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else None  # bf16 activations: what the NVFP4 kernels take
    policy, tokenizer, _ = build_policy(cfg.model, device=device, dtype=dtype, seed=cfg.seed)
    return Trainer(policy, tokenizer, make_task(cfg.data), cfg, progress="none"), policy


def worker(args) -> dict:
    """One process's step and its hashes."""
    from qerl_kit.kernels import tuning

    if args.torch_deterministic:  # torch's deterministic kernels where it has them; a warning names the rest
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(args.seed)
    trainer, policy = build_trainer(args, Path(tempfile.mkdtemp(prefix="bench-repro-")))  # its run files
    seen: dict = {}
    prepare = trainer._prepare

    def spy(*args):  # the step's rollout and its OldPolicy (filled by the pass or the update)
        prep = prepare(*args)
        seen["prep"] = prep
        return prep
    trainer._prepare = spy
    before = adapter_sha(policy)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = trainer.train_step()
    prep = seen["prep"]
    nondeterministic = sorted({str(w.message).split(" does not have a deterministic")[0][:120] for w in caught
                               if "deterministic" in str(w.message)})
    return dict(pid=os.getpid(), seconds=round(time.perf_counter() - start, 2), autotune=tuning.mode(),
                timed=sum(k.timed for k in tuning.TUNED.values()), loss=float(metrics.get("loss", float("nan"))),
                completion_ids=sha(prep.batch.completion_ids), rollout_logprobs=sha(prep.batch.logprobs),
                old_logprobs=sha(prep.old.old_logp if prep.old.ready else None), adapter=adapter_sha(policy),
                adapter_changed=adapter_sha(policy) != before, torch_nondeterministic=nondeterministic,
                backend=os.environ.get("QERL_KERNEL_BACKEND", "auto"))


def versions() -> dict:
    from bench.common import package_versions

    return dict(python=platform.python_version(), torch=torch.__version__,
                **package_versions(triton="triton", transformers="transformers", humming="humming-kernels"))


def report(args, rows: list[dict]) -> str:
    """The markdown table: machine, date, versions, one row per process, and the verdict per field."""
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU only ({os.cpu_count()} cores, {platform.machine()})"
    same = {f: len({r[f] for r in rows}) == 1 for f in FIELDS}
    lines = [f"# NVFP4 bit-reproducibility across {len(rows)} processes", "",
             f"{machine}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             + ", ".join(f"{k} {v}" for k, v in versions().items()), "",
             f"`python -m bench.bench_repro {' '.join(sys.argv[1:])}`: preset {args.preset}"
             f"{f', model {args.model}' if args.model else ''}, seed {args.seed}, {args.prompts} x {args.group} "
             f"completions of {args.new} tokens, temperature {args.temperature}, autotune "
             f"{rows[0]['autotune'] if rows else '?'}, kernel backend {rows[0]['backend'] if rows else '?'}, "
             f"torch deterministic algorithms {'on' if args.torch_deterministic else 'off'}", "",
             "| process | tile timings | step s | adapter moved | " + " | ".join(f"{f} sha256" for f in FIELDS) + " |",
             "|---|---|---|---|" + "---|" * len(FIELDS)]
    for i, r in enumerate(rows):
        lines.append(f"| {i} | {r['timed']} | {r['seconds']} | {'yes' if r['adapter_changed'] else '**no**'} | "
                     + " | ".join(f"`{r[f][:16]}`" for f in FIELDS) + " |")
    lines += ["", "| | " + " | ".join(FIELDS) + " |", "|---|" + "---|" * len(FIELDS),
              "| identical in every process | " + " | ".join("yes" if same[f] else "**no**" for f in FIELDS) + " |"]
    flagged = sorted({op for r in rows for op in r["torch_nondeterministic"]})
    if args.torch_deterministic:
        lines += ["", "torch ops without a deterministic kernel in the step: "
                  + ("; ".join(f"`{op}`" for op in flagged) if flagged else "none")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/repro"))
    ap.add_argument("--preset", default="tiny-cpu", help="a qerl_kit.config preset (tiny-cpu, real-gsm8k)")
    ap.add_argument("--model", default=None, help="overrides the preset's model.name (tiny, a directory or a .gguf)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new", type=int, default=16, help="new tokens per completion")
    ap.add_argument("--temperature", type=float, default=1.5,
                    help="sampling temperature (above 1: the tiny model's groups need differing rewards, "
                         "or the step changes nothing)")
    ap.add_argument("--autotune", default="cache", choices=["cache", "pinned", "time"])
    ap.add_argument("--cache", default=None, help="the autotune cache file (default: a fresh one in --out)")
    ap.add_argument("--backend", default=None,
                    help="QERL_KERNEL_BACKEND for the workers (auto; on a GPU also ours: no humming, triton, ...)")
    ap.add_argument("--torch-deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True, warn_only=True) and "
                         "CUBLAS_WORKSPACE_CONFIG=:4096:8; the ops torch has no deterministic kernel for are listed")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a child writes its row here
    args = ap.parse_args(argv)
    if args.worker:
        Path(args.worker).write_text(json.dumps(worker(args)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out / "autotune.json"
    if not args.cache:
        cache.unlink(missing_ok=True)  # the first process times the kernels
    env = {**os.environ, "QERL_AUTOTUNE": args.autotune, "QERL_AUTOTUNE_CACHE": str(cache)}
    if args.backend:
        env["QERL_KERNEL_BACKEND"] = args.backend
    if args.torch_deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # what cuBLAS needs for deterministic results under torch's flag
    rows = []
    for i in range(args.processes):
        row_file = out / f"process{i}.json"
        cmd = [sys.executable, "-m", "bench.bench_repro", *(argv if argv is not None else sys.argv[1:]),
               "--worker", str(row_file)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
            return proc.returncode
        rows.append(json.loads(row_file.read_text()))
        row_file.unlink()
        print(f"process {i}: {rows[-1]}", flush=True)
    text = report(args, rows)
    (out / "repro.md").write_text(text)
    (out / "repro.json").write_text(json.dumps(dict(args=vars(args), versions=versions(), rows=rows), indent=1))
    print(text)
    return 0 if all(len({r[f] for r in rows}) == 1 for f in FIELDS) else 1


if __name__ == "__main__":
    sys.exit(main())
