"""The ``qerl`` command line: ``demo`` (the main job), ``train``, ``eval`` and ``quantize``."""

from __future__ import annotations

import argparse
import errno
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from qerl_kit.demo import run_demo

    run_demo(model=args.model, dataset=args.dataset, steps=args.steps, seed=args.seed,
             output_dir=args.output_dir, eval_size=args.eval_size, fmt=args.format,
             progress="text" if args.no_widgets else "auto")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from qerl_kit.models import PRESETS, build_model, check_model_source, load_pretrained
    from qerl_kit.quantize import check_skip, memory_report, quantize_model, quantized_head

    _check_shard_size(args.shard_size)  # before minutes of loading and quantizing
    if args.out and args.format != "nvfp4":
        print(f"qerl quantize: --out writes a compressed-tensors NVFP4 checkpoint; --format "
              f"{args.format} cannot be exported (use --format nvfp4)", file=sys.stderr)
        return 2
    kind = check_model_source(args.model, presets=PRESETS)  # a missing path or a preset typo: said first
    # the model directory whose tokenizer files the export copies (none for a preset, a .gguf or a hub id)
    source = args.model if kind == "dir" else None
    if args.out:  # refuse an unsafe --out before minutes of loading and quantizing
        from qerl_kit.export import check_export_dirs

        check_export_dirs(args.out, source_dir=source)
    tokenizer = None
    if kind == "preset":
        model = build_model(args.model, dtype=torch.bfloat16)
    else:
        model, tokenizer = load_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    check_skip(model, args.skip)  # a name that matches no layer: a ConfigError, said first
    head = quantized_head(model, tuple(args.skip))
    tied = head is not None and bool(getattr(model.config, "tie_word_embeddings", False))
    if head is not None and (args.out or tied):  # --skip replaces the default lm_head, it does not add to it
        why = "it is tied to the embedding" if tied else "an --out export keeps it dense, as vLLM does"
        print(f"qerl quantize: --skip {' '.join(args.skip) or '(empty)'} leaves the output head {head!r} to be "
              f"quantized, but {why}; --skip replaces the default, so add {head.rsplit('.', 1)[-1]} "
              f"(--skip {' '.join(args.skip + [head.rsplit('.', 1)[-1]])})", file=sys.stderr)
        return 2
    try:
        report = quantize_model(model, fmt=args.format, skip=tuple(args.skip))
    except ValueError as err:  # a skip name that matches nothing or leaves nothing, an already-quantized model
        print(f"qerl quantize: {err}", file=sys.stderr)
        return 2
    print(report)
    print()
    print(memory_report(model))
    if args.out:
        from qerl_kit.export import save_nvfp4

        save_nvfp4(model, args.out, tokenizer=tokenizer, source_dir=source, max_shard_size=args.shard_size)
        print(f"\nwrote an NVFP4 (compressed-tensors nvfp4-pack-quantized) checkpoint to {args.out}; "
              f"serve it with: vllm serve {args.out}")
    return 0


def _check_shard_size(text: str) -> int:
    """``--shard-size`` in bytes (``ct_format.parse_size``: 2GB, 500MB, 1GiB, 4096), or a ConfigError."""
    from qerl_kit.config_types import ConfigError, short_repr
    from qerl_kit.ct_format import parse_size

    try:
        return parse_size(text)
    except (ValueError, OverflowError):
        raise ConfigError(f"--shard-size must be a positive size in bytes such as 2GB, 500MB, 1GiB or 4096; "
                          f"got {short_repr(text)}", "--shard-size", text) from None


def _train_config(args: argparse.Namespace):
    """The run's TrainConfig: --config or --preset, with --output-dir, --engine and --model applied."""
    from qerl_kit.config import load_config, preset
    from qerl_kit.config_types import ConfigError

    cfg = load_config(args.config) if args.config else preset(args.preset)
    if args.output_dir:
        cfg = cfg.replace(output_dir=args.output_dir)
    if args.engine:  # the config's own rule says which names are allowed (rollout.ENGINES)
        try:
            cfg = cfg.replace(rollout={"engine": args.engine})
        except ConfigError as err:
            raise ConfigError(f"--engine {args.engine}: {err}", err.key, err.value, err.allowed) from None
    if args.model:
        cfg = cfg.replace(model={"name": args.model})
    return cfg


def _fit_schedule(args: argparse.Namespace, cfg, latest, main: bool):
    """``cfg`` with the lr schedule and AQN stages fitted to ``--steps`` on a new run of a long preset
    (which would otherwise spend itself in warm-up and the first AQN stage), unless --keep-schedule."""
    if args.config or latest is not None or args.steps is None or args.steps >= cfg.total_steps or args.keep_schedule:
        return cfg
    stages = min(cfg.aqn.stages, args.steps)
    if cfg.aqn.enabled and stages < 3:
        if main:
            print(f"qerl train: --steps {args.steps} is shorter than AQN's 3 stages; the schedule keeps "
                  f"total_steps {cfg.total_steps}, so this run ends early in it")
        return cfg
    if main:
        print(f"qerl train: --steps {args.steps} on a new run of preset {args.preset!r}: the lr schedule "
              f"and AQN stages span {args.steps} steps instead of its total_steps {cfg.total_steps} "
              f"(--keep-schedule keeps {cfg.total_steps})")
    return cfg.replace(total_steps=args.steps, aqn={"stages": stages})


def _announce_run(cfg, latest) -> None:
    """The first line of a run: which run this is (resumed, new, or new with the old one moved aside)."""
    from qerl_kit import runs

    if latest is not None:
        print(f"qerl train: resuming the run in {cfg.output_dir} from step {latest.name.split('-')[1]} ({latest})")
    elif runs.run_files(cfg.output_dir):
        print(f"qerl train: starting a new run in {cfg.output_dir}; the run found there moves to "
              f"{cfg.output_dir}/{runs.PREVIOUS}/")
    else:
        print(f"qerl train: starting a new run in {cfg.output_dir}")


def _cmd_train(args: argparse.Namespace) -> int:
    from qerl_kit import checkpoint as ckpt
    from qerl_kit import distributed, runs
    from qerl_kit.build import build_policy
    from qerl_kit.config import save_config
    from qerl_kit.config_types import check_steps
    from qerl_kit.models import BASE_NAMES, check_model_source
    from qerl_kit.optim import steps_to_run
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    if args.steps is not None:  # the trainer's own check, before anything loads
        check_steps("--steps", args.steps)
    launched = distributed.init()  # under torchrun / accelerate launch: one rank per process
    main = distributed.is_main()
    cfg = _train_config(args)
    if main:  # the directory is this process's (a second live run is refused) before anything loads
        runs.lock(cfg.output_dir)
    latest = None if args.fresh else ckpt.latest_checkpoint(cfg.output_dir)
    cfg = _fit_schedule(args, cfg, latest, main)
    # the trainer's own check (no steps past total_steps at lr 0), before the model loads
    steps_to_run("--steps", cfg, int(latest.name.split("-")[1]) if latest is not None else 0, args.steps)
    check_model_source(cfg.model.name, presets=BASE_NAMES)  # before the task's data and minutes of loading
    if main:
        _announce_run(cfg, latest)
    device = distributed.device() if torch_cuda_available() else None  # cuda:LOCAL_RANK (cuda:0 on one process)
    policy, tokenizer, report = build_policy(cfg.model, device=device, seed=cfg.seed)
    if report is not None and main:
        print(report.summary())
    trainer = Trainer(policy, tokenizer, make_task(cfg.data), cfg, progress="text" if args.no_widgets else "auto")
    if latest is not None:
        step = trainer.resume(latest, allow_config_change=args.allow_config_change)
        if main:
            print(f"resumed from step {step} in {cfg.output_dir}")
    else:
        trainer.claim_output_dir("train")
    if main:
        save_config(cfg, trainer.output_dir / "config.yaml")
    trainer.train(args.steps)
    trainer.save()
    if args.eval and main:
        result = trainer.evaluate()
        print(f"held-out accuracy: {result.accuracy:.3f}")
    if launched:
        distributed.barrier()
        distributed.shutdown()
    return 0


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _eval_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:  # "gpu", "cuda:x": refused here, before the model loads, not by the first tensor moved
        kind = torch.device(name).type
    except (RuntimeError, ValueError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here (use --device cpu or auto)")
    return name


def _eval_size(args: argparse.Namespace) -> int:
    """The rows ``qerl eval`` asks the task for, once its options are checked (SamplingParams' and
    data.eval_size's rules, before minutes of loading): without --limit all rows of a data file,
    and data.eval_size's default (200) of a generated task (arith, countdown: "all" has no end)."""
    from qerl_kit.config import DataConfig
    from qerl_kit.config_types import (DATA_ROWS_MAX, EVAL_SIZE_RULE, NEW_TOKENS_RULE, TOP_P_RULE, check_rule,
                                       check_temperature, check_value)

    if args.limit is not None:
        check_rule("--limit", args.limit, int, EVAL_SIZE_RULE)
    check_value("--samples", args.samples, int, ge=1, why="samples per problem; pass@1 is their mean")
    check_value("--batch-size", args.batch_size, int | None, ge=1, why="problems per engine call")
    check_temperature("--temperature", args.temperature, greedy=True)
    check_rule("--top-p", args.top_p, float, TOP_P_RULE)
    if args.max_new_tokens is not None:
        check_rule("--max-new-tokens", args.max_new_tokens, int, NEW_TOKENS_RULE)
    from qerl_kit.tasks.registry import FILE_TASKS

    from_file = args.dataset in FILE_TASKS or args.dataset.endswith(".jsonl")
    return args.limit or (DATA_ROWS_MAX if from_file else DataConfig().eval_size)


def _eval_model(args: argparse.Namespace, device: str):
    """The model ``qerl eval`` scores: loaded, quantized to --format (unless it already is), with
    --adapter applied; (model, tokenizer)."""
    import torch

    from qerl_kit.build import load_base, quantize_base
    from qerl_kit.config import ModelConfig

    mcfg = ModelConfig(name=args.model, format=args.format, trust_remote_code=args.trust_remote_code)
    dtype = torch.bfloat16 if device.startswith("cuda") and args.model != "tiny" else None
    model, tokenizer = load_base(mcfg, device=device, dtype=dtype)
    quantize_base(model, args.format, "--format", f"model {args.model}")  # an export loads already quantized
    if args.adapter:
        from qerl_kit.lora import load_lora

        model = load_lora(model, args.adapter)  # the adapter is applied (the official eval forgot)
    return model, tokenizer


def _cmd_eval(args: argparse.Namespace) -> int:
    import time

    from qerl_kit.config import DataConfig
    from qerl_kit.models import BASE_NAMES, check_model_source
    from qerl_kit.rollout.registry import make_engine
    from qerl_kit.tasks import make_task

    eval_size = _eval_size(args)
    try:
        device = _eval_device(args.device)
    except ValueError as err:
        print(f"qerl eval: {err}", file=sys.stderr)
        return 2
    check_model_source(args.model, presets=BASE_NAMES)  # a bad path fails before the data and the model load
    if args.adapter:  # a missing adapter directory or config fails before the model loads
        from qerl_kit.lora import lora_config_for

        lora_config_for(args.adapter)
    task = make_task(DataConfig(dataset=args.dataset, eval_size=eval_size))
    rows = task.eval[:args.limit] if args.limit else task.eval  # the first --limit rows
    t0 = time.perf_counter()
    model, tokenizer = _eval_model(args, device)
    load_s = time.perf_counter() - t0
    engine = make_engine(args.engine, model, tokenizer)
    max_new = args.max_new_tokens or task.max_new_tokens or 256
    print(f"qerl eval: {len(rows)} {task.name} problems, {max_new} new tokens, {device}, engine "
          f"{type(engine).__name__}, model loaded and quantized in {load_s:.1f} s", flush=True)
    from qerl_kit.evaluate import evaluate_task

    result = evaluate_task(task, model, tokenizer, rows, engine=engine, samples=args.samples,
                           temperature=args.temperature, top_p=args.top_p, max_new_tokens=max_new,
                           batch_size=args.batch_size)
    print(result)
    print(result.speed_line())
    if args.out:
        result.save(args.out, meta={"model": args.model, "format": args.format, "dataset": args.dataset,
                                    "device": device, "engine": type(engine).__name__, "adapter": args.adapter,
                                    "max_new_tokens": max_new, "top_p": args.top_p})
        print(f"wrote {args.out}")
    return 0


def _names(names) -> str:
    """Registry names for a help text: ``a, b, c or d``."""
    names = list(names)
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def _add_demo(sub, formats: tuple[str, ...], tasks: str) -> None:
    demo = sub.add_parser("demo", help="run the tiny-model QeRL demo on this machine (CPU is fine)")
    demo.add_argument("--model", default="tiny",
                      help="'tiny' (the shipped model), a local HF model directory, a .gguf file or a hub id")
    demo.add_argument("--dataset", default="arith", help=f"{tasks} or a GSM8K-style .jsonl")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the tiny-cpu preset's)")
    demo.add_argument("--format", default="nvfp4", choices=formats,
                      help="the weight format of the frozen base (none: bf16 LoRA)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.add_argument("--eval-size", type=int, default=None, help="held-out problems to evaluate")
    demo.add_argument("--output-dir", default="runs/demo",
                      help="where summary.json, curves.png, metrics.jsonl and checkpoints go; a run already there "
                           "moves to OUTPUT_DIR/previous-runs/ (default runs/demo)")
    demo.add_argument("--no-widgets", action="store_true", help="plain text progress bar")
    demo.set_defaults(func=_cmd_demo)


def _add_quantize(sub, formats: tuple[str, ...]) -> None:
    quant = sub.add_parser("quantize", help="quantize a model and print the per-layer report")
    quant.add_argument("model", help="a preset name, a local HF model directory, a .gguf file or a hub id")
    quant.add_argument("--format", default="nvfp4", choices=formats, help="the 4-bit weight format")
    quant.add_argument("--skip", nargs="*", default=["lm_head"],
                       help="layer names (or name parts) to keep dense")
    quant.add_argument("--trust-remote-code", action="store_true",
                       help="allow a model directory's own Python code to run (off by default)")
    quant.add_argument("--out", metavar="DIR",
                       help="also write a vLLM-loadable NVFP4 checkpoint (compressed-tensors) to DIR")
    quant.add_argument("--shard-size", default="2GB",
                       help="with --out: largest safetensors shard, e.g. 2GB or 500MB (default 2GB)")
    quant.set_defaults(func=_cmd_quantize)


def _add_train(sub, engines: str, presets: str) -> None:
    train = sub.add_parser("train", help="run GRPO/DAPO from a YAML config (resumes from its last checkpoint); "
                                         "data-parallel under torchrun --nproc_per_node N -m qerl_kit.cli train ...")
    train.add_argument("--config", help="a YAML file: optional `preset: name` plus sections "
                                        "(model, data, rollout, loss, optim, aqn) overriding it")
    train.add_argument("--preset", default="tiny-cpu", help=f"a named preset when no --config is given ({presets})")
    train.add_argument("--steps", type=int, default=None,
                       help="steps to run now (default: to total_steps); on a new run of a --preset with fewer "
                            "steps than its total_steps, the lr schedule and AQN stages are fitted to these steps")
    train.add_argument("--keep-schedule", action="store_true",
                       help="with --steps on a new run of a preset: keep its total_steps for the schedule")
    train.add_argument("--model", help="the base model, overriding model.name: 'tiny', a local HF directory, a .gguf "
                                       "file or a hub id")
    train.add_argument("--output-dir", help="where checkpoints and metrics.jsonl go (overrides the config; "
                                            "default: the config's output_dir, runs/train)")
    train.add_argument("--engine", help=f"the rollout engine, overriding the config's rollout.engine: {engines} "
                                        "(vllm needs a CUDA GPU and `pip install 'qerl_kit[vllm]'`)")
    train.add_argument("--fresh", action="store_true",
                       help="start a new run instead of resuming; a run already in the output directory moves to "
                            "OUTPUT_DIR/previous-runs/ (nothing is deleted)")
    train.add_argument("--allow-config-change", action="store_true",
                       help="resume even though the config differs from the checkpoint's (applied to the "
                            "optimizer, lr schedule and AQN, logged to config_changes.jsonl)")
    train.add_argument("--eval", action="store_true", help="evaluate on the held-out split at the end")
    train.add_argument("--no-widgets", action="store_true", help="plain text progress bar")
    train.set_defaults(func=_cmd_train)


def _add_eval(sub, formats: tuple[str, ...], tasks: str, engines: str) -> None:
    ev = sub.add_parser("eval", help="pass@1 of a (quantized) model with an optional LoRA adapter")
    ev.add_argument("--model", default="tiny", help="'tiny', a local HF model directory, a .gguf file or a hub id "
                                                    "(when online)")
    ev.add_argument("--format", default="nvfp4", choices=formats,
                    help="quantize the base to this format first (none: keep it dense)")
    ev.add_argument("--adapter", help="a peft adapter directory (e.g. runs/train/checkpoint-60)")
    ev.add_argument("--dataset", default="arith", help=f"{tasks} (data files: local JSON Lines in $QERL_DATA, "
                                                       "./data or ../shared/data) or a GSM8K-style .jsonl")
    ev.add_argument("--limit", type=int, default=None,
                    help="score the first N problems, at most 10**6 (default: all rows of a data file; 200 problems "
                         "of a generated task such as arith)")
    ev.add_argument("--device", default="auto", help="auto (a CUDA GPU when there is one), cpu, cuda or cuda:N")
    ev.add_argument("--engine", default="auto", help=f"rollout engine: {engines} (auto: static on a GPU, hf on "
                                                     "the CPU)")
    ev.add_argument("--batch-size", type=int, default=None,
                    help="problems per engine call (default: all of them; the engine batches rows itself)")
    ev.add_argument("--samples", type=int, default=1, help="samples per problem (pass@1 is averaged)")
    ev.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; the paper used 0.6")
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (the paper used 0.95)")
    ev.add_argument("--max-new-tokens", type=int, default=None,
                    help="completion length limit (default: the task's: gsm8k 512, math500 1024, arith 64)")
    ev.add_argument("--out", help="also write the result (summary and every completion) to this .json file")
    ev.add_argument("--trust-remote-code", action="store_true", help="allow a model's own code (off by default)")
    ev.set_defaults(func=_cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    """The ``qerl`` parser. Its name choices are read from the registries now (``formats.FORMATS``,
    ``tasks.TASKS``, ``rollout.ENGINES``, ``config.PRESETS``), so a name registered at runtime is a
    choice of the parser built after it."""
    from qerl_kit.config import PRESETS
    from qerl_kit.formats import format_names
    from qerl_kit.rollout.registry import engine_names
    from qerl_kit.tasks.registry import task_names

    parser = argparse.ArgumentParser(prog="qerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tasks, engines = _names(task_names()), _names(engine_names())
    _add_demo(sub, format_names(), tasks)
    _add_quantize(sub, format_names(dense=False))
    _add_train(sub, engines, _names(PRESETS))
    _add_eval(sub, format_names(), tasks, engines)
    return parser


def main(argv: list[str] | None = None) -> int:
    from qerl_kit.checkpoint import CheckpointError
    from qerl_kit.config_types import ConfigError
    from qerl_kit.data import DataError
    from qerl_kit.finite import NonFiniteError
    from qerl_kit.gguf_model import GGUFError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileExistsError, CheckpointError) as err:  # a refusal that protects the user's files or run
        print(f"qerl {args.command}: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, GGUFError, DataError) as err:  # a model or data path/file not there or not usable
        print(f"qerl {args.command}: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # a value refused where it entered (a config key, --steps, --skip ...)
        print(f"qerl {args.command}: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:  # NaN/inf stopped at its source: the message names the tensor, file or step
        print(f"qerl {args.command}: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk (file_writes.DiskFullError and plain ENOSPC) names the path
        if err.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            raise
        print(f"qerl {args.command}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
