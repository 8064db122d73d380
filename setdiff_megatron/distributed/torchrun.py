"""torchrun for every local launch, ended with its launcher and quiet about a user's error.

    [SETDIFF_ERROR_DIR=DIR] python -m setdiff_megatron.distributed.torchrun TORCHRUN_ARGS...

Once the launcher is gone, by SIGKILL too, torchrun stops its workers with SIGTERM, as on a
preemption, and exits (docs/fault-tolerance.md, "A launcher's death ends its run"). Once a worker
has handed the launcher a UserError, torchrun's own report of the failure is left out and it exits
with code 2 (docs/training.md, "Training and checkpoints"); any other failure is reported as usual.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed import run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from setdiff_megatron.distributed.child_processes import follow_parent
from setdiff_megatron.errors import ERROR_DIR_ENV, EXIT_USER_ERROR, handed_over


class _UnlessHandedOver(logging.Filter):
    """Lets a log record through only while no worker has handed over a UserError: a worker
    writes its message before it exits, so it is there before torchrun logs the failure."""

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = directory

    def filter(self, record: logging.LogRecord) -> bool:
        return handed_over(self.directory) is None


def _handlers_of(name: str) -> list[logging.Handler]:
    """The handlers that the records of logger `name` reach, wherever torch installed them."""
    logger: logging.Logger | None = logging.getLogger(name)
    found: list[logging.Handler] = []
    while logger is not None:
        found += logger.handlers
        logger = logger.parent if logger.propagate else None
    return found or [logging.lastResort]


def main() -> int:
    """torchrun's exit code; 2 without torchrun's report once a worker handed over a UserError;
    128 + the signal's number, without a traceback, when a signal stopped it (its workers were
    stopped first)."""
    follow_parent()
    directory = Path(os.environ[ERROR_DIR_ENV]) if ERROR_DIR_ENV in os.environ else None
    if directory is not None:
        for handler in _handlers_of("torch.distributed.elastic"):
            handler.addFilter(_UnlessHandedOver(directory))
    try:
        run.main()
    except ChildFailedError:
        if directory is None or handed_over(directory) is None:
            raise
        return EXIT_USER_ERROR
    except SignalException as stop:
        return 128 + stop.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
