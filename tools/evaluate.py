#!/usr/bin/env python
"""Evaluation jobs (likelihood, generate, infill, sweep, lm-eval); the same as `setdiff eval`.

    python tools/evaluate.py likelihood RUN --data docs.jsonl --out runs/eval/nll

Every argument is the subcommand's; `--help` prints its help.
"""

import sys

from _subcommand import run

if __name__ == "__main__":
    sys.exit(run("eval"))
