"""The training loop's checkpoint saves: synchronous, or in the background, one at a time.

A save wraps the engine's files in checkpoint/publish.py's two halves: `begin_publication` makes
`step_N.tmp`; `finish_publication` hashes, verifies and renames it to `step_N`, then moves
`latest`. A background save (`checkpoint.async_save`) is published at the first step boundary
where every rank's writer is done (`poll`), so `latest` never names a checkpoint whose files are
not all on disk. Whatever the loop waits for here is the hang watchdog's save phase.
docs/training.md ("Training and checkpoints") has the rest.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from setdiff_megatron.checkpoint.names import CHECKPOINTS, TOKENIZER_DIR
from setdiff_megatron.checkpoint.publish import Retention, begin_publication, finish_publication, publish
from setdiff_megatron.checkpoint.state import Progress, TrainState, write_train_state
from setdiff_megatron.distributed import runtime
from setdiff_megatron.distributed.fault_injection import Faults
from setdiff_megatron.distributed.signals import blocked
from setdiff_megatron.recipes import Recipe, save_resolved_recipe
from setdiff_megatron.training.engines import Engine
from setdiff_megatron.training.metric_sinks import MetricsLogger
from setdiff_megatron.training.watchdog import SAVE, Watchdog

__all__ = ["Checkpointer"]


def _write_run_files(
    tmp: Path, recipe: Recipe, engine: Engine, progress: Progress, identity: dict, tokenizer, run_id: str
) -> None:
    """Rank 0's files of a checkpoint: the train state (progress as of the save), recipe, tokenizer."""
    if runtime.rank() != 0:
        return
    write_train_state(
        tmp,
        TrainState(
            progress=progress,
            scheduler=engine.scheduler_state(),
            layout=engine.layout_record(),
            model=identity,
            tokenizer={"vocab_size": tokenizer.vocab_size, "mask_id": tokenizer.mask_id},
            run_id=run_id,
            ema=engine.ema_state(),
        ),
    )
    save_resolved_recipe(recipe, tmp)
    tokenizer.save(tmp / TOKENIZER_DIR)


@dataclass
class _InFlight:
    step: int
    started: float
    blocked_s: float


class Checkpointer:
    """Saves of one run, each published once complete; `last` is the newest published."""

    def __init__(
        self,
        recipe: Recipe,
        engine: Engine,
        identity: dict,
        tokenizer,
        run_id: str,
        logger: MetricsLogger,
        last: Path | None = None,
        watchdog: Watchdog | None = None,
        faults: Faults | None = None,
    ):
        self.recipe, self.engine, self.identity, self.tokenizer, self.run_id = (
            recipe,
            engine,
            identity,
            tokenizer,
            run_id,
        )
        self.logger, self.last, self.watchdog, self.faults = logger, last, watchdog, faults
        self.root = Path(recipe.checkpoint.dir) / CHECKPOINTS
        self.retention = Retention(recipe.checkpoint.keep_last_n, recipe.checkpoint.keep_every_n_steps)
        self._in_flight: _InFlight | None = None
        self._published: Path | None = None

    def _saving(self, step: int) -> contextlib.AbstractContextManager:
        """The watchdog's save phase of `step`, if there is a watchdog."""
        return self.watchdog.phase(SAVE, step) if self.watchdog is not None else contextlib.nullcontext()

    def _drill(self, step: int) -> None:
        if self.faults is not None:
            self.faults.in_save(step)

    def save(self, progress: Progress, *, background: bool) -> None:
        """Collective: save the state at `progress`, in the background if asked (after waiting for
        a save still in flight) or now. Logs `checkpoint/blocked_s` (how long the step loop stood
        still for it, the wait for an earlier save included) and `checkpoint/write_s` (from its
        start to its publication). SETDIFF_INJECT's `at=save` drills fire inside it, before the
        save is published."""
        start = time.perf_counter()
        if self._in_flight is not None:
            self.wait(because=f"the save of step {progress.step} came due")
        step = progress.step
        with self._saving(step):
            if not background:
                self.last = publish(
                    self.root,
                    step,
                    lambda tmp: self._write(tmp, progress),
                    run_id=self.run_id,
                    retention=self.retention,
                )
                seconds = time.perf_counter() - start
                self.logger.log(
                    step, {"checkpoint/step": step, "checkpoint/blocked_s": seconds, "checkpoint/write_s": seconds}
                )
                return
            with blocked():
                tmp = begin_publication(self.root, step)
            self.engine.start_save(tmp, lambda: self._publish(step, tmp))
            _write_run_files(tmp, self.recipe, self.engine, progress, self.identity, self.tokenizer, self.run_id)
            self._drill(step)
            self._in_flight = _InFlight(step, start, time.perf_counter() - start)

    def _write(self, tmp: Path, progress: Progress) -> None:
        """A synchronous save's files: the engine's, then the run's."""
        self.engine.save(tmp)
        _write_run_files(tmp, self.recipe, self.engine, progress, self.identity, self.tokenizer, self.run_id)
        self._drill(progress.step)

    def poll(self, step: int) -> None:
        """Collective, at a step boundary: publish the save in flight if every rank wrote it."""
        self._finish(step, blocking=False)

    def wait(self, *, because: str | None = None, step: int | None = None) -> None:
        """Collective: finish the save in flight, if any, and say how long that took."""
        if self._in_flight is None:
            return
        start, saving = time.perf_counter(), self._in_flight.step
        self._finish(step if step is not None else saving, blocking=True)
        if because is not None:
            self.logger.message(
                f"{because} while the save of step {saving} was still writing: waited "
                f"{time.perf_counter() - start:.1f} s for it"
            )

    def _finish(self, step: int, *, blocking: bool) -> None:
        if self._in_flight is None:
            return
        waited = time.perf_counter()
        with self._saving(self._in_flight.step):
            if not self.engine.finish_saves(blocking=blocking):  # publishes once every rank's files are written
                return
        saving, self._in_flight = self._in_flight, None
        now = time.perf_counter()
        self.last = self._published
        self.logger.log(
            step,
            {
                "checkpoint/step": saving.step,
                "checkpoint/blocked_s": saving.blocked_s + (now - waited if blocking else 0.0),
                "checkpoint/write_s": now - saving.started,
            },
        )

    def _publish(self, step: int, tmp: Path) -> None:
        """The second half of a background save, run on every rank by the engine's finalization."""
        self._published = finish_publication(self.root, step, tmp, run_id=self.run_id, retention=self.retention)
