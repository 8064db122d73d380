#!/usr/bin/env python
"""The OpenAI-compatible server; the same as `setdiff serve`.

    python tools/serve.py RUN --port 8000 --batch-size 16

Every argument is the subcommand's; `--help` prints its help.
"""

import sys

from _subcommand import run

if __name__ == "__main__":
    sys.exit(run("serve"))
