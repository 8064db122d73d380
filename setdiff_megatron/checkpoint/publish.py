"""Publishing a checkpoint: written aside, hashed, renamed into place, then `latest`; and retention.

Every engine writes its files through `publish`, a collective call, and a crash at any point leaves
every published checkpoint as it was. What is already saved is never lost: a published directory
of the same step (a resumed run reaching a step saved before, or another run's checkpoint) is moved
aside, never deleted or overwritten, and reported; retention removes only this run's own valid
checkpoints older than the newest valid one (docs/training.md, "Training and checkpoints").
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from setdiff_megatron.checkpoint.manifest import verify, write_manifest
from setdiff_megatron.checkpoint.names import LATEST, aside_name, find_checkpoints, step_name, step_of
from setdiff_megatron.checkpoint.state import read_train_state
from setdiff_megatron.distributed.runtime import barrier, rank
from setdiff_megatron.distributed.signals import blocked
from setdiff_megatron.errors import UserError
from setdiff_megatron.log import say

__all__ = [
    "Retention",
    "publish",
    "begin_publication",
    "finish_publication",
    "apply_retention",
    "check_writable",
    "move_aside",
]


class Retention:
    """Which of a run's checkpoints to keep: the newest `keep_last_n` (None: all) and every one
    whose step is a multiple of `keep_every_n_steps`."""

    def __init__(self, keep_last_n: int | None = None, keep_every_n_steps: int | None = None):
        self.keep_last_n, self.keep_every_n_steps = keep_last_n, keep_every_n_steps

    def keeps(self, index: int, step: int) -> bool:
        every = self.keep_every_n_steps
        return self.keep_last_n is None or index < self.keep_last_n or bool(every and step % every == 0)


def run_id_of(directory: Path) -> str | None:
    """The run that wrote a checkpoint, or None (unreadable state, or written before run ids)."""
    try:
        return read_train_state(directory).run_id
    except UserError:
        return None


def move_aside(path: Path, why: str) -> Path:
    """Rename `path` to a free `<name>.<why>-<time>` beside it and say so (whichever rank moved it);
    returns the new path."""
    aside = aside_name(path, why)
    path.rename(aside)
    say(f"setdiff: moved {path} aside to {aside.name} (nothing deleted)", everywhere=True)
    return aside


def apply_retention(root: Path, run_id: str, retention: Retention) -> list[Path]:
    """Remove what `retention` lets go of among this run's valid checkpoints older than the
    newest valid one; return what was removed."""
    valid = [c for c in find_checkpoints(root) if verify(c, checksums=False) is None]
    if not valid:
        return []
    newest = step_of(valid[0])
    ours = [c for c in valid if run_id_of(c) == run_id]
    removed = []
    for index, path in enumerate(ours):
        if step_of(path) < newest and not retention.keeps(index, step_of(path)):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def publish(
    root: Path, step: int, write: Callable[[Path], None], *, run_id: str | None, retention: Retention = Retention()
) -> Path:
    """Collective: publish the checkpoint of `step` that `write(tmp)` writes on every rank, and
    return the published directory.
      1. preemption signals are blocked, so a save is never cut half-way by SIGTERM/SIGUSR1;
      2. rank 0 clears interrupted saves (`step_*.tmp`: never published, never valid) and makes
         `step_N.tmp` (`begin_publication`); every rank writes its files there (`write(tmp)`);
      3. the ranks hash the files (a share each) into the manifest;
      4. rank 0 renames it to `step_N` (atomic on one filesystem) and only then moves `latest`
         (`finish_publication`, steps 3 and 4).
    An asynchronous save (training/checkpointer.py) runs the same two halves with the engine's
    files written in between, while training goes on: step 4 happens only once every rank's files
    are on disk. `run_id` None: no training run wrote it (an import), so no run's retention
    applies."""
    with blocked():
        tmp = begin_publication(root, step)
        write(tmp)
        return finish_publication(root, step, tmp, run_id=run_id, retention=retention)


def begin_publication(root: Path, step: int) -> Path:
    """Collective: a fresh `step_N.tmp` for every rank to write into (stale ones cleared first:
    the caller has no save of its own still writing)."""
    tmp = root / f"{step_name(step)}.tmp"
    if rank() == 0:
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def finish_publication(
    root: Path, step: int, tmp: Path, *, run_id: str | None, retention: Retention = Retention()
) -> Path:
    """Collective, once every rank's files are in `tmp`: hash them into the manifest, verify,
    rename to `step_N`, then move `latest` and apply the run's retention."""
    final = root / step_name(step)
    with blocked():
        barrier()
        write_manifest(tmp)
        if rank() == 0:
            problem = verify(tmp, checksums=False)  # the files other ranks wrote, as seen here
            if problem:
                raise RuntimeError(f"checkpoint {tmp} failed verification: {problem}")
            if final.exists():
                move_aside(final, "replaced")
            tmp.rename(final)
            pointer = root / f"{LATEST}.tmp"
            pointer.write_text(final.name + "\n")
            pointer.replace(root / LATEST)
            if run_id is not None:
                apply_retention(root, run_id, retention)
        barrier()
    return final


def check_writable(directory: Path, need_bytes: int) -> None:
    """Fail in seconds, not after hours: `directory` must take a file, and its disk must have
    room for one more checkpoint of `need_bytes` (an estimate)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise UserError(f"checkpoint.dir {directory} is not writable: {exc.strerror or exc}") from None
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise UserError(
            f"checkpoint.dir {directory} has {free / 2**30:.2f} GiB free; a checkpoint of this "
            f"model needs about {need_bytes / 2**30:.2f} GiB"
        )
