"""A heartbeat per step, and a thread that ends the process when the beats stop.

A hung rank (a peer lost mid-collective, a deadlocked data worker, a stuck filesystem) holds every
other rank in its next collective until the process-group timeout, 30 minutes by default, and then
fails without saying who or where. The training loop beats at each step start; when no beat comes
for `train.hang_timeout_s`, this thread prints one line naming the rank, the step and the frame the
main thread is stuck in, writes every thread's stack to `logs/hang-rank<N>.txt`, and exits the
process with EXIT_HANG, on which torchrun (`launch.max_restarts`) restarts the job from its newest
checkpoint. It cannot save a checkpoint: that takes collectives the hung rank will not join; the
last published checkpoint is intact, and metrics.jsonl is flushed line by line.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

from setdiff_megatron.log import write

__all__ = ["Watchdog", "EXIT_HANG"]

EXIT_HANG = 76
"""The exit code of a process the watchdog ended (75, EXIT_REQUEUE, is a preemption's)."""


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, log_dir: Path, *, poll_s: float | None = None):
        self.timeout_s, self.rank, self.log_dir = timeout_s, rank, log_dir
        self.poll_s = poll_s or min(5.0, timeout_s / 4)
        self.step: int | None = None
        self.last_beat = time.monotonic()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="setdiff-watchdog", daemon=True)
        self._main = threading.main_thread().ident

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()

    def beat(self, step: int) -> None:
        self.step, self.last_beat = step, time.monotonic()

    def _where(self) -> str:
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "an unknown frame"
        return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            waited = time.monotonic() - self.last_beat
            if waited < self.timeout_s:
                continue
            step = "before the first step" if self.step is None else f"at step {self.step}"
            dump = self.log_dir / f"hang-rank{self.rank}.txt"
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                with open(dump, "w") as f:
                    faulthandler.dump_traceback(f, all_threads=True)
            except OSError:
                dump = None
            write(
                f"setdiff: rank {self.rank}: no progress for {waited:.0f} s {step} (train.hang_timeout_s = "
                f"{self.timeout_s:g}), stuck in {self._where()}; "
                + (f"stacks in {dump}; " if dump else "")
                + f"exiting with code {EXIT_HANG} so the launcher restarts from the last checkpoint",
                sys.stderr,
            )
            os._exit(EXIT_HANG)
