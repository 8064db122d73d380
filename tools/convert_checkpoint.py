#!/usr/bin/env python
"""Convert checkpoints to and from Hugging Face format; the same as `setdiff convert`.

    python tools/convert_checkpoint.py to-hf runs/tiny-cpu hf/tiny-setdiff --check

Every argument is the subcommand's; `--help` prints its help.
"""

import sys

from _subcommand import run

if __name__ == "__main__":
    sys.exit(run("convert"))
