"""A hang watchdog: each phase of the training loop has a timeout, and a rank stuck past it exits.

A hung rank holds every other rank in its next collective until the process-group timeout (30
minutes by default), then fails without saying who or where. Here a thread ends the process with
EXIT_HANG instead, naming the rank, the phase and the stuck frame, and torchrun restarts the job
from its newest checkpoint. It never saves a checkpoint: that takes collectives the hung rank
will not join. Phases, keys and defaults: docs/fault-tolerance.md ("Settings").
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from setdiff_megatron.distributed import runtime
from setdiff_megatron.distributed.child_processes import ChildProcesses
from setdiff_megatron.log import write
from setdiff_megatron.recipes import Recipe

__all__ = ["Watchdog", "Phase", "phase_timeouts", "EXIT_HANG", "STARTUP", "STEP", "EVALUATION", "SAVE", "ROLLBACK"]

EXIT_HANG = 76
"""The exit code of a process the watchdog ended (75, EXIT_REQUEUE, is a preemption's)."""

LONG_PHASE_FACTOR = 4
"""An unset save or start-up timeout is this many step timeouts. A margin, not a measurement: a
save writes the weights and the optimizer state, several times the weights' bytes, and a model
whose save takes longer than four step timeouts sets its own key."""


@dataclass(frozen=True)
class Phase:
    what: str
    """What the rank is doing, as the watchdog's line says it ({step} filled in)."""
    key: str
    """The train.* key of its timeout."""


STARTUP = Phase("the start-up (process groups, data, model build, resume)", "startup_timeout_s")
FIRST_STEP = Phase("step {step}, the first since the start-up", "startup_timeout_s")
STEP = Phase("step {step}", "hang_timeout_s")
EVALUATION = Phase("the evaluation at step {step}", "eval_timeout_s")
SAVE = Phase("the checkpoint save of step {step}", "save_timeout_s")
ROLLBACK = Phase("the rollback reload at step {step}", "save_timeout_s")


def phase_timeouts(recipe: Recipe) -> dict[str, float]:
    """Seconds for each timeout key: the recipe's, or for an unset one its rule: start-up and save
    LONG_PHASE_FACTOR x hang_timeout_s; an evaluation hang_timeout_s x eval.batches (global
    batches, each of a step's micro-batches, which run forward only and so take less than a step's)."""
    t = recipe.train
    rules = {
        "hang_timeout_s": t.hang_timeout_s,
        "startup_timeout_s": LONG_PHASE_FACTOR * t.hang_timeout_s,
        "eval_timeout_s": t.hang_timeout_s * recipe.eval.batches,
        "save_timeout_s": LONG_PHASE_FACTOR * t.hang_timeout_s,
    }
    return {key: rule if getattr(t, key) is None else getattr(t, key) for key, rule in rules.items()}


class Watchdog:
    """Watches the main thread's phases once entered (a context manager); it starts in STARTUP."""

    def __init__(
        self,
        timeouts: dict[str, float],
        rank: int,
        log_dir: Path,
        children: ChildProcesses | None = None,
        *,
        poll_s: float | None = None,
    ):
        self.timeouts, self.rank, self.log_dir, self.children = timeouts, rank, log_dir, children
        watched = [s for s in timeouts.values() if s > 0]
        self.poll_s = poll_s or min([5.0] + [s / 4 for s in watched])
        self._doing: tuple[Phase, int | None, float] = (STARTUP, None, time.monotonic())
        """The phase, its step and when it began, replaced whole (the thread reads it unlocked)."""
        self._stepped = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="setdiff-watchdog", daemon=True)
        self._main = threading.main_thread().ident
        self._on = bool(watched)

    @classmethod
    def for_run(cls, recipe: Recipe, children: ChildProcesses) -> Watchdog:
        return cls(
            phase_timeouts(recipe),
            runtime.rank(),
            Path(recipe.checkpoint.dir) / "logs",
            children,
        )

    def __enter__(self) -> Watchdog:
        if self._on:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()

    def beat(self, step: int) -> None:
        """Training step `step` starts. The first of this process still counts as start-up: it
        warms up (allocations, compilation, the first collectives of every group)."""
        self._doing = (STEP if self._stepped else FIRST_STEP, step, time.monotonic())
        self._stepped = True

    @contextlib.contextmanager
    def phase(self, phase: Phase, step: int | None = None) -> Iterator[Watchdog]:
        """`phase` for the time of the block, then back to the phase before, its clock restarted:
        the block finishing was progress."""
        outer, outer_step, _ = self._doing
        self._doing = (phase, step, time.monotonic())
        try:
            yield self
        finally:
            self._doing = (outer, outer_step, time.monotonic())

    def _where(self) -> str:
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "an unknown frame"
        return f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"

    def overdue(self, now: float) -> str | None:
        """What the rank has been doing for longer than its timeout at `now`, as the watchdog's
        line says it, or None."""
        phase, step, since = self._doing
        timeout = self.timeouts[phase.key]
        if not 0 < timeout <= now - since:
            return None
        return (
            f"no progress for {now - since:.0f} s in {phase.what.format(step=step)} (train.{phase.key} = {timeout:g})"
        )

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            if (stalled := self.overdue(time.monotonic())) is not None:
                self._end(stalled)

    def _end(self, stalled: str) -> None:
        dump = self.log_dir / f"hang-rank{self.rank}.txt"
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(dump, "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError:
            dump = None
        write(
            f"setdiff: rank {self.rank}: {stalled}, stuck in {self._where()}; "
            + (f"stacks in {dump}; " if dump else "")
            + f"exiting with code {EXIT_HANG} so the launcher restarts from the last checkpoint",
            sys.stderr,
        )
        if self.children is not None:
            self.children.kill()
        os._exit(EXIT_HANG)
