"""A stand-in rank for test_fault_tolerance_units.py: the processes of a checkpoint save in flight,
then an end of the way named on the command line.

It starts what megatron-core's background save runs on (the results-queue manager through
`start_manager`, a forked writer with preemption signals blocked, and the writer's forked worker,
both stuck in their files), prints how many processes it started, and ends inside the watchdog's
save phase: `end` returns, `error` raises, `watchdog` hangs until the save timeout (exit 76),
`killed` SIGKILLs itself.

    python tests/training/helper_processes_rank.py end|error|watchdog|killed LOG_DIR
"""

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path


def write_files() -> None:
    """A writer stuck in its files, with a worker of its own stuck too."""
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,)).start()
    time.sleep(600)


def main(way: str, log_dir: Path) -> None:
    from setdiff_megatron.distributed.child_processes import ChildProcesses, start_manager
    from setdiff_megatron.distributed.signals import PREEMPTION_SIGNALS, blocked
    from setdiff_megatron.training.watchdog import SAVE, Watchdog

    children = ChildProcesses()
    start_manager(ignore=PREEMPTION_SIGNALS).Queue()
    with blocked():
        multiprocessing.get_context("fork").Process(target=write_files).start()
    while len(children.alive()) < 3:
        time.sleep(0.05)
    print(f"started {len(children.alive())}", flush=True)
    timeouts = dict(hang_timeout_s=60.0, save_timeout_s=1.0, eval_timeout_s=60.0, startup_timeout_s=60.0)
    with Watchdog(timeouts, 0, log_dir, children, poll_s=0.05) as watchdog:
        try:
            with watchdog.phase(SAVE, 5):
                if way == "error":
                    raise RuntimeError("a failure during the save")
                if way == "watchdog":
                    time.sleep(600)
                if way == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
        finally:
            children.end(wait_s=1.0)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
