"""The field's whole GRPO step at bench_step's shapes: TRL's ``GRPOTrainer`` on a bitsandbytes NF4 base
(QLoRA), on a bf16 base, and Unsloth's GRPO path, one command, one table.

    python -m bench.bench_trl_step --out OUT [--stacks trl-nf4 trl-bf16 unsloth] [--model Qwen2.5-7B|tiny|DIR]
        [--prompts 8] [--group 8] [--new 512] [--prompt-len 256] [--micro-batch 8] [--mu 1] [--lora-r 32]
        [--gradient-checkpointing on|off] [--steps 3] [--loss grpo|dapo] [--trl-vllm off|colocate]

The model: a ``qerl_kit.models`` preset's shape with random bf16 weights written once as a checkpoint with a
byte-level word tokenizer (``bench.random_checkpoint``, in $TMPDIR and removed at the end, or kept under
``--keep-checkpoint DIR`` for the next call), ``tiny`` (the
shipped tiny model, CPU tests) or a model directory (e.g. the real 0.5B ``bench/device.sh model-setup``
converts to /tmp/m05). Every stack loads that same directory.

The stacks (``bench.trl_stack``): ``trl-nf4`` = transformers + ``BitsAndBytesConfig`` (NF4, double
quantization, bf16 compute: QLoRA) + peft LoRA + ``trl.GRPOTrainer``; ``trl-bf16`` = the same on the bf16
base; both generate with transformers' ``generate`` unless ``--trl-vllm colocate`` (TRL's vLLM colocate
mode). ``unsloth`` = ``FastLanguageModel.from_pretrained(load_in_4bit, fast_inference)`` +
``get_peft_model`` + TRL's GRPOTrainer as Unsloth patches it, ``use_vllm`` (its shared-weight vLLM engine).
LoRA: r = alpha = ``--lora-r`` on all seven projections, dropout 0. GRPO: ``--prompts`` x ``--group`` rows,
one optimizer step per rollout in micro-batches of ``--micro-batch`` (gradient accumulation), mu =
``num_iterations``, beta 0, lr 1e-5 constant, AdamW (0.9, 0.99), no weight decay, clip 0.2, max grad norm 1,
temperature 1; every completion exactly ``--new`` tokens (EOS suppressed; each row records the lengths seen);
prompts of exactly ``--prompt-len`` random word tokens; a seeded random reward.

Each stack runs in its own process (one stack's CUDA memory and Unsloth's monkeypatching must not reach the
next); a stack that fails (import error, out of memory, a crash, the time limit) is a row with its error.
Output: OUT/rows.jsonl (one row per stack and measured step: settings, versions, step_s, rollout_s,
generate_s, update_s, tokens/s, peak GiB, completion lengths) and OUT/step.md (``bench.trl_report``).
Step 1 pays compilation and allocator warm-up: its row is marked ``warmup`` and the table reports it apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.child_rows import crash_line, read_rows

STACKS = ("trl-nf4", "trl-bf16", "unsloth")
SETTINGS = ["stack", "model", "prompts", "group", "rows", "new", "prompt_len", "micro_batch", "mu", "lora_r", "loss",
            "lr", "gradient_checkpointing", "steps", "seed", "trl_vllm", "vllm_memory"]


def _choice(kind: str, allowed):
    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{kind} {value!r}: allowed {', '.join(allowed)}")
        return value
    return check


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for rows.jsonl, step.md and the stacks' logs")
    p.add_argument("--stacks", nargs="+", default=list(STACKS), type=_choice("stack", STACKS))
    p.add_argument("--model", default="Qwen2.5-7B", help="a qerl_kit.models preset (random weights), tiny, or a "
                   "model directory")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="completions per prompt (TRL's num_generations)")
    p.add_argument("--new", type=int, default=512, help="tokens of every completion (fixed)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--mu", type=int, default=1, help="optimizer steps per rollout (TRL's num_iterations)")
    p.add_argument("--lora-r", type=int, default=32)
    p.add_argument("--loss", default="grpo", type=_choice("loss", ("grpo", "dapo")),
                   help="grpo: bench_step's loss (qerl_kit's Trainer there); dapo: qerl_kit's config default")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--gradient-checkpointing", default="on", type=_choice("gradient-checkpointing", ("on", "off")))
    p.add_argument("--steps", type=int, default=3, help="rollout cycles; the first is the warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-vllm", default="off", type=_choice("trl-vllm", ("off", "colocate")),
                   help="generation of the trl-* stacks: transformers' generate (off) or TRL's vLLM colocate mode")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="gpu_memory_utilization of every vLLM engine")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which no new stack starts")
    p.add_argument("--limit", type=float, default=None, help="seconds after which a stack's process is killed "
                   "(default budget + 120)")
    p.add_argument("--keep-checkpoint", default=None, metavar="DIR",
                   help="write a preset's random checkpoint under DIR and keep it; a later call reuses it (same "
                        "seed, same weights); default: a temp dir removed at the end")
    p.add_argument("--isolate", default="on", type=_choice("isolate", ("on", "off")),
                   help="on: each stack in a fresh process (off: this one; tests)")
    return p


def check_args(a) -> None:
    """Refuse settings TRL would refuse later or that break the step's shape, naming the flag."""
    for key in ("prompts", "new", "prompt_len", "micro_batch", "mu", "lora_r", "steps"):
        if getattr(a, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} {getattr(a, key)}: must be >= 1")
    if a.group < 2:
        raise SystemExit(f"--group {a.group}: GRPO needs >= 2 completions per prompt (advantages within a group)")
    rows = a.prompts * a.group
    if rows % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch}: must divide prompts x group = {rows} (one optimizer step "
                         "is exactly one rollout, in equal micro-batches)")
    if not 0 < a.lr <= 1:
        raise SystemExit(f"--lr {a.lr}: must be in (0, 1]")
    if not 0 < a.vllm_memory < 1:
        raise SystemExit(f"--vllm-memory {a.vllm_memory}: must be in (0, 1) (vLLM's gpu_memory_utilization)")
    from qerl_kit.models import PRESETS

    if a.model != "tiny" and a.model not in PRESETS and not Path(a.model).expanduser().is_dir():
        raise SystemExit(f"--model {a.model!r}: allowed tiny, a model directory or a qerl_kit.models preset: "
                         f"{', '.join(PRESETS)}")
    if len(set(a.stacks)) != len(a.stacks):
        raise SystemExit(f"--stacks {' '.join(a.stacks)}: a stack is named twice")


def settings(a, stack: str) -> dict:
    s = {k: getattr(a, k) for k in SETTINGS if k not in ("stack", "rows")}
    s.update(stack=stack, rows=a.prompts * a.group, gradient_checkpointing=a.gradient_checkpointing == "on")
    return s


def meta() -> dict:
    """Date, GPU and every package version the stacks use (package metadata: nothing imported)."""
    from bench.bench_step import gpu_name
    from bench.common import package_versions

    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=gpu_name(),
                **package_versions(torch="torch", transformers="transformers", peft="peft", trl="trl",
                                   datasets="datasets", bitsandbytes="bitsandbytes", unsloth="unsloth",
                                   unsloth_zoo="unsloth_zoo", vllm="vllm", accelerate="accelerate"))


def model_dir(a, work: Path) -> tuple[str, dict]:
    """(the directory every stack loads, how it was made)."""
    if a.model == "tiny":
        from qerl_kit.tiny import TINY_DIR

        return str(TINY_DIR), {"model_source": "the shipped tiny model"}
    if Path(a.model).expanduser().is_dir():
        return str(Path(a.model).expanduser()), {"model_source": "a model directory"}
    d = (Path(a.keep_checkpoint) if a.keep_checkpoint else work) / f"random-{a.model}"
    spec = d / "bench_checkpoint.json"  # written last: its presence means the checkpoint is whole
    if spec.exists() and json.loads(spec.read_text()).get("preset") == a.model:  # seed 0: the same weights
        return str(d), {"model_source": "random bf16 weights of the preset's shape (reused)",
                        **json.loads(spec.read_text())}
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    if a.isolate == "on":  # a fresh process: this one must hold no CUDA context while the stacks run
        rc = subprocess.run([sys.executable, "-m", "bench.bench_trl_step", "--checkpoint", a.model, str(d), str(spec)],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if rc != 0 or not spec.exists():
            raise SystemExit(f"--model {a.model}: writing the random checkpoint failed (exit {rc})")
    else:
        write_checkpoint(a.model, str(d), spec)
    return str(d), {"model_source": "random bf16 weights of the preset's shape", **json.loads(spec.read_text())}


def write_checkpoint(preset: str, path: str, spec: Path) -> None:
    import torch

    from bench.random_checkpoint import write_random_checkpoint

    info = write_random_checkpoint(preset, path, "cuda" if torch.cuda.is_available() else "cpu")
    spec.write_text(json.dumps({"preset": preset, **info}))


def failure(err: BaseException) -> dict:
    oom = "out of memory" in str(err).lower() or type(err).__name__ == "OutOfMemoryError"
    return dict(status="oom" if oom else "error", error=f"{type(err).__name__}: {err}".splitlines()[0][:400])


def interpret_triton() -> None:
    """TRL 1.15's GRPOTrainer computes log-probs with a Triton kernel (``trl.kernels.chunked_logprob``); without
    a GPU it runs in Triton's CPU interpreter, which must be switched on before Triton is imported, with
    qerl_kit's NumPy >= 2.4 fix of the interpreter (``patch_interpreter_for_numpy24``)."""
    import torch

    if torch.cuda.is_available():
        return
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from qerl_kit.kernels.backend import interpreting, patch_interpreter_for_numpy24

    if interpreting():
        patch_interpreter_for_numpy24()


def stack_in_process(s: dict, path: str, work: Path, rows_path: Path, base: dict):
    """Run one stack here; append its rows (or one failed row) to ``rows_path``; return the trainer or None."""
    from bench.trl_stack import run_stack

    interpret_triton()
    trainer = None
    try:
        results, trainer = run_stack(s, path, work)
        out = [{**base, **r, "status": "ok", "error": ""} for r in results]
    except BaseException as err:  # noqa: BLE001 - SystemExit too: some libraries exit on a failed init
        traceback.print_exc()
        out = [{**base, **failure(err)}]
    with open(rows_path, "a") as f:
        for r in out:
            f.write(json.dumps(r, default=str) + "\n")
    return trainer


def stack_isolated(s: dict, path: str, work: Path, rows_path: Path, base: dict, timeout: float) -> None:
    """The stack in a fresh process (``--worker``, its output in OUT/<stack>_log.txt); no row back (a crash,
    the limit) is a ``crashed`` row."""
    spec = work / "spec.json"
    spec.write_text(json.dumps(dict(settings=s, model_dir=path, base=base)))
    log_path = rows_path.parent / f"{s['stack']}_log.txt"
    before = len(read_rows(rows_path))
    with open(log_path, "w") as logf:
        # a session of its own: at the limit the whole group goes (vLLM may start engine processes of its own,
        # which would otherwise keep their GPU memory through the next stack)
        proc = subprocess.Popen([sys.executable, "-m", "bench.bench_trl_step", "--worker", str(spec), str(rows_path)],
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = "timeout (killed at --limit)"
        try:  # the worker's group: whatever it left running (after os._exit too) holds no GPU memory any more
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if len(read_rows(rows_path)) == before:
        with open(rows_path, "a") as f:
            f.write(json.dumps({**base, "status": "crashed", "error": f"process exit {rc}: {crash_line(log_path)}"})
                    + "\n")
    print(f"[bench_trl_step] {s['stack']}: process exit {rc}", flush=True)


def run(a) -> list[dict]:
    """Every stack of the call, then OUT/step.md. Returns the rows."""
    from bench.trl_report import write_report

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    rows_path.unlink(missing_ok=True)
    start, info = time.perf_counter(), meta()
    limit = a.budget + 120 if a.limit is None else a.limit
    work = Path(tempfile.mkdtemp(prefix="bench-trl-step-"))
    try:
        path, source = model_dir(a, work)
        for stack in a.stacks:
            s = settings(a, stack)
            base = {**info, **s, **source}
            left = a.budget - (time.perf_counter() - start)
            if left <= 0:
                with open(rows_path, "a") as f:
                    f.write(json.dumps({**base, "status": "skipped", "error": "the call's --budget was spent "
                                        "before this stack started"}) + "\n")
            elif a.isolate == "on":
                (work / stack).mkdir()
                stack_isolated(s, path, work / stack, rows_path, base, limit - (time.perf_counter() - start))
            else:
                stack_in_process(s, path, work / stack, rows_path, base)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the random checkpoint (15 GB at 7B) and the trainers' folders
    rows = read_rows(rows_path)
    write_report(rows, out)
    print(f"[bench_trl_step] wrote {out}/rows.jsonl and step.md ({len(rows)} rows)", flush=True)
    return rows


def offline_env() -> None:
    """No network on the GPU machine (as bench.probe_unsloth): hub, telemetry and usage-stat calls stay local.
    Set before any HF, Unsloth or vLLM import of this process; the workers inherit it."""
    for k, v in dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                     HF_HUB_DISABLE_TELEMETRY="1", UNSLOTH_DISABLE_STATISTICS="1", VLLM_NO_USAGE_STATS="1",
                     DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false", HF_HUB_ENABLE_HF_TRANSFER="0",
                     VLLM_USE_FLASHINFER_SAMPLER="0").items():  # the last two as the probe that ran on the H200
        os.environ.setdefault(k, v)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    offline_env()
    if argv[:1] == ["--worker"]:  # internal: one stack in this process
        spec = json.loads(Path(argv[1]).read_text())
        stack_in_process(spec["settings"], spec["model_dir"], Path(argv[1]).parent, Path(argv[2]), spec["base"])
        sys.stdout.flush()
        os._exit(0)  # vLLM's engine can hang interpreter teardown; the rows are written
    if argv[:1] == ["--checkpoint"]:  # internal: the random checkpoint, in a process of its own
        write_checkpoint(argv[1], argv[2], Path(argv[3]))
        return 0
    a = parser().parse_args(argv)
    check_args(a)
    run(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
