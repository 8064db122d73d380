"""The `setdiff` command.

Each subcommand parses its arguments and calls one library function. Errors a user can fix
(`UserError`) print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from setdiff_megatron.errors import UserError
from setdiff_megatron.version import __version__


def _train(args: argparse.Namespace) -> int:
    from setdiff_megatron.training.preview import PreviewConfig, run_preview

    cfg = PreviewConfig(out_dir=args.out_dir, steps=args.steps, seed=args.seed)
    print("setdiff train (preview): single-process torch model on the Python standard library's "
          "source bytes; the megatron-core engine and YAML recipes are not wired in yet.")
    log = run_preview(cfg)
    print(f"held-out loss {log['valid_loss_before']:.3f} -> {log['valid_loss_after']:.3f} nats/token "
          f"(ln 257 = 5.549); {log['tokens_per_s']:.0f} tokens/s")
    print(f"checkpoint: {cfg.out_dir}/model.pt  log: {cfg.out_dir}/log.json")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="setdiff",
        description="Train, sample and evaluate set diffusion language models.",
    )
    parser.add_argument("--version", action="version", version=f"setdiff-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a model (preview: a short CPU run on a built-in corpus)",
                           description="Preview of the main job: trains the torch model for a few "
                           "hundred steps on the standard library's source and saves it.")
    train.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    train.add_argument("--out-dir", default="runs/preview", help="where the checkpoint and log go")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except UserError as exc:
        print(f"setdiff: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("setdiff: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
