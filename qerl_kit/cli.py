"""The ``qerl`` command line: ``qerl demo`` (the main job) and ``qerl quantize``."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    from qerl_kit.demo import run_demo

    run_demo(model=args.model, fmt=args.format, seed=args.seed)
    return 0


def _cmd_quantize(args: argparse.Namespace) -> int:
    import torch

    from qerl_kit.models import PRESETS, build_model, load_model
    from qerl_kit.quantize import memory_report, quantize_model

    if args.model in PRESETS:
        model = build_model(args.model, dtype=torch.bfloat16)
    else:
        model = load_model(args.model, trust_remote_code=args.trust_remote_code)
    report = quantize_model(model, fmt=args.format, skip=tuple(args.skip))
    print(report)
    print()
    print(memory_report(model))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the tiny-model QeRL demo on this machine (CPU is fine)")
    demo.add_argument("--model", default="qwen2-tiny",
                      help="a preset name (see qerl_kit.models.PRESETS) or a local HF model directory")
    demo.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "nf4"],
                      help="the 4-bit weight format of the frozen base")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.set_defaults(func=_cmd_demo)

    quant = sub.add_parser("quantize", help="quantize a model and print the per-layer report")
    quant.add_argument("model", help="a preset name or a local HF model directory")
    quant.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4", "nf4"],
                       help="the 4-bit weight format")
    quant.add_argument("--skip", nargs="*", default=["lm_head"],
                       help="layer names (or name parts) to keep dense")
    quant.add_argument("--trust-remote-code", action="store_true",
                       help="allow a model directory's own Python code to run (off by default)")
    quant.set_defaults(func=_cmd_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
