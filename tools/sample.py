#!/usr/bin/env python
"""Cached any-order sampling of a JSONL of prompts; the same as `setdiff sample`.

    torchrun --nproc_per_node 8 tools/sample.py RUN --prompts p.jsonl --out out.jsonl --tp 2

Every argument is the subcommand's; `--help` prints its help.
"""

import sys

from _subcommand import run

if __name__ == "__main__":
    sys.exit(run("sample"))
