"""The one way a job speaks to the console: status lines, notes, warnings and errors.

A multi-process job runs the same code on every rank, so a line printed there appears once per
process; `say` lets rank 0 speak for the job, and a line every rank must say (`everywhere`)
carries `rank N: ` on the others, so interleaved logs stay readable. On a terminal a line goes
through tqdm, above a progress bar instead of through it (progress.py); anywhere else (a SLURM
log, CI, a pipe) it is a plain flushed line. What a command produces (a table, a rendered job
script, a listing) is not said but printed, by the command itself.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import TextIO

from setdiff_megatron.progress import interactive

__all__ = ["say", "write", "rank"]


def rank() -> int:
    """This process's rank: torch.distributed's once a process group is up, else the launcher's
    RANK (0 without a launcher). torch is not imported for the question."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def write(text: str, file: TextIO | None = None) -> None:
    """`text` as one line on `file` (default: stdout) from this process, whatever its rank: for a
    line that names its rank itself (a watchdog's, a fault drill's)."""
    file = file or sys.stdout
    if interactive(file):
        from tqdm import tqdm

        tqdm.write(text, file=file)
    else:
        print(text, file=file)
    file.flush()


def say(text: str, *, file: TextIO | None = None, everywhere: bool = False) -> None:
    """`text` as a line on `file` (default: stdout) from rank 0; with `everywhere`, from every
    rank, prefixed `rank N: ` on the others (every line of it)."""
    me = rank()
    if me == 0:
        write(text, file)
    elif everywhere:
        write(textwrap.indent(text, f"rank {me}: "), file)
