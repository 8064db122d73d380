"""`setdiff eval lm-eval ARGS`: lm-evaluation-harness's command line with our "setdiff" model
registered (evaluation/lm_eval_adapter.py); ARGS are lm-eval's own."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def _run(args) -> int:
    from setdiff_megatron.evaluation import lm_eval_adapter

    lm_eval_adapter.main(args.lm_eval_args)
    return 0


def add_parser(jobs) -> None:
    # Every argument, --help included, is lm-eval's: no option prefix of our own, so none is taken here.
    parser = jobs.add_parser(
        "lm-eval",
        prefix_chars="+",
        add_help=False,
        help="run lm-evaluation-harness tasks with --model setdiff (needs the lm_eval extra)",
        description="lm-evaluation-harness with the 'setdiff' model type registered; every argument goes to "
        "lm-eval, e.g. setdiff eval lm-eval --model setdiff --model_args pretrained=RUN,window=4,threshold=0.9 "
        "--tasks TASK --include_path DIR. Same as python -m setdiff_megatron.evaluation.lm_eval_adapter.",
    )
    parser.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments of lm-eval")
    parser.set_defaults(func=_run)
