"""The ``qerl`` command line: ``demo`` (the main job), ``train``, ``eval`` and ``quantize``."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from qerl_kit.demo import run_demo

    run_demo(model=args.model, dataset=args.dataset, steps=args.steps, seed=args.seed,
             output_dir=args.output_dir, eval_size=args.eval_size, fmt=args.format,
             progress="text" if args.no_widgets else "auto")
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from qerl_kit.models import PRESETS, build_model, load_model
    from qerl_kit.quantize import memory_report, quantize_model

    if args.out and args.format != "nvfp4":
        print(f"qerl quantize: --out writes a compressed-tensors NVFP4 checkpoint; --format "
              f"{args.format} cannot be exported (use --format nvfp4)", file=sys.stderr)
        return 2
    if args.out:  # refuse an unsafe --out before minutes of loading and quantizing
        from qerl_kit.export import check_export_dirs

        check_export_dirs(args.out, source_dir=None if args.model in PRESETS else args.model)
    if args.model in PRESETS:
        model = build_model(args.model, dtype=torch.bfloat16)
    else:
        model = load_model(args.model, trust_remote_code=args.trust_remote_code)
    report = quantize_model(model, fmt=args.format, skip=tuple(args.skip))
    print(report)
    print()
    print(memory_report(model))
    if args.out:
        from qerl_kit.export import save_nvfp4

        source = None if args.model in PRESETS else args.model
        save_nvfp4(model, args.out, source_dir=source, max_shard_size=args.shard_size)
        print(f"\nwrote an NVFP4 (compressed-tensors nvfp4-pack-quantized) checkpoint to {args.out}; "
              f"serve it with: vllm serve {args.out}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from qerl_kit import checkpoint as ckpt
    from qerl_kit import distributed, runs
    from qerl_kit.build import build_policy
    from qerl_kit.config import load_config, preset, save_config
    from qerl_kit.tasks import make_task
    from qerl_kit.trainer import Trainer

    launched = distributed.init()  # under torchrun / accelerate launch: one rank per process
    main = distributed.is_main()
    cfg = load_config(args.config) if args.config else preset(args.preset)
    if args.output_dir:
        cfg = cfg.replace(output_dir=args.output_dir)
    if args.engine:  # the config's own rule says which names are allowed
        try:
            cfg = cfg.replace(rollout={"engine": args.engine})
        except ValueError as err:
            print(f"qerl train: --engine {args.engine}: {err}", file=sys.stderr)
            return 2
    latest = None if args.fresh else ckpt.latest_checkpoint(cfg.output_dir)
    if main:  # the first line says which run this is
        if latest is not None:
            print(f"qerl train: resuming the run in {cfg.output_dir} from step {latest.name.split('-')[1]} ({latest})")
        elif runs.run_files(cfg.output_dir):
            print(f"qerl train: starting a new run in {cfg.output_dir}; the run found there moves to "
                  f"{cfg.output_dir}/{runs.PREVIOUS}/")
        else:
            print(f"qerl train: starting a new run in {cfg.output_dir}")
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


def _cmd_eval(args: argparse.Namespace) -> int:
    from qerl_kit.build import load_base
    from qerl_kit.config import DataConfig, ModelConfig
    from qerl_kit.lora import load_lora
    from qerl_kit.quantize import quantize_model
    from qerl_kit.tasks import make_task

    mcfg = ModelConfig(name=args.model, format=args.format, trust_remote_code=args.trust_remote_code)
    model, tokenizer = load_base(mcfg)
    if args.format != "none":
        quantize_model(model, fmt=args.format)
    if args.adapter:
        model = load_lora(model, args.adapter)  # the adapter is applied (the official eval forgot)
    task = make_task(DataConfig(dataset=args.dataset, eval_size=args.limit))
    result = task.evaluate(model, tokenizer, samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                           max_new_tokens=args.max_new_tokens)
    print(result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the tiny-model QeRL demo on this machine (CPU is fine)")
    demo.add_argument("--model", default="tiny",
                      help="'tiny' (the shipped model) or a local HF model directory")
    demo.add_argument("--dataset", default="arith",
                      help="arith (the synthetic task), gsm8k, math500 or a GSM8K-style .jsonl")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the tiny-cpu preset's)")
    demo.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "nf4", "none"],
                      help="the weight format of the frozen base (none: bf16 LoRA)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.add_argument("--eval-size", type=int, default=None, help="held-out problems to evaluate")
    demo.add_argument("--output-dir", default="runs/demo",
                      help="where summary.json, curves.png, metrics.jsonl and checkpoints go; a run already there "
                           "moves to OUTPUT_DIR/previous-runs/ (default runs/demo)")
    demo.add_argument("--no-widgets", action="store_true", help="plain text progress bar")
    demo.set_defaults(func=_cmd_demo)

    quant = sub.add_parser("quantize", help="quantize a model and print the per-layer report")
    quant.add_argument("model", help="a preset name or a local HF model directory")
    quant.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "nf4"],
                       help="the 4-bit weight format")
    quant.add_argument("--skip", nargs="*", default=["lm_head"],
                       help="layer names (or name parts) to keep dense")
    quant.add_argument("--trust-remote-code", action="store_true",
                       help="allow a model directory's own Python code to run (off by default)")
    quant.add_argument("--out", metavar="DIR",
                       help="also write a vLLM-loadable NVFP4 checkpoint (compressed-tensors) to DIR")
    quant.add_argument("--shard-size", default="2GB",
                       help="with --out: largest safetensors shard, e.g. 2GB or 500MB (default 2GB)")
    quant.set_defaults(func=_cmd_quantize)

    train = sub.add_parser("train", help="run GRPO/DAPO from a YAML config (resumes from its last checkpoint); "
                                         "data-parallel under torchrun --nproc_per_node N -m qerl_kit.cli train ...")
    train.add_argument("--config", help="a YAML file: optional `preset: name` plus sections "
                                        "(model, data, rollout, loss, optim, aqn) overriding it")
    train.add_argument("--preset", default="tiny-cpu", help="a named preset when no --config is given "
                                                            "(tiny-cpu, paper-gsm8k, paper-bigmath)")
    train.add_argument("--steps", type=int, default=None, help="steps to run now (default: to total_steps)")
    train.add_argument("--output-dir", help="where checkpoints and metrics.jsonl go (overrides the config; "
                                            "default: the config's output_dir, runs/train)")
    train.add_argument("--engine", help="the rollout engine, overriding the config's rollout.engine: auto, static, "
                                        "hf or vllm (vllm needs a CUDA GPU and `pip install 'qerl_kit[vllm]'`)")
    train.add_argument("--fresh", action="store_true",
                       help="start a new run instead of resuming; a run already in the output directory moves to "
                            "OUTPUT_DIR/previous-runs/ (nothing is deleted)")
    train.add_argument("--allow-config-change", action="store_true",
                       help="resume even though the config differs from the checkpoint's (applied to the "
                            "optimizer, lr schedule and AQN, logged to config_changes.jsonl)")
    train.add_argument("--eval", action="store_true", help="evaluate on the held-out split at the end")
    train.add_argument("--no-widgets", action="store_true", help="plain text progress bar")
    train.set_defaults(func=_cmd_train)

    ev = sub.add_parser("eval", help="pass@1 of a (quantized) model with an optional LoRA adapter")
    ev.add_argument("--model", default="tiny", help="'tiny' or a local HF model directory")
    ev.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "nf4", "none"],
                    help="quantize the base to this format first (none: keep it dense)")
    ev.add_argument("--adapter", help="a peft adapter directory (e.g. runs/train/checkpoint-60)")
    ev.add_argument("--dataset", default="arith", help="arith, gsm8k, math500 or a GSM8K-style .jsonl")
    ev.add_argument("--limit", type=int, default=200, help="number of held-out problems")
    ev.add_argument("--samples", type=int, default=1, help="samples per problem (pass@1 is averaged)")
    ev.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; the paper used 0.6")
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (the paper used 0.95)")
    ev.add_argument("--max-new-tokens", type=int, default=256, help="completion length limit")
    ev.add_argument("--trust-remote-code", action="store_true", help="allow a model's own code (off by default)")
    ev.set_defaults(func=_cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    from qerl_kit.checkpoint import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileExistsError, CheckpointError) as err:  # a refusal that protects the user's files or run
        print(f"qerl {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
