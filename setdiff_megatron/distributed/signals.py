"""Preemption: SIGTERM or SIGUSR1 -> a checkpoint at the next step boundary -> exit code 75.

The handler only records the signal. At every step boundary the loop asks `agreed()`, an
all-reduce (MAX) over the world, so every rank saves the same step even when the signal reached
one process only. EXIT_REQUEUE = 75 is EX_TEMPFAIL of sysexits.h: the run is intact and resumes
from the checkpoint it just wrote. Saves run with the signals `blocked`, so the processes a save
starts cannot be killed half-way through it. How this meets SLURM, Kubernetes and torchrun:
docs/fault-tolerance.md ("Preemption").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["EXIT_REQUEUE", "PREEMPTION_SIGNALS", "Preempted", "PreemptionHandler", "blocked", "supervise_launch"]

EXIT_REQUEUE = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_FILE = "preempted.json"


class Preempted(Exception):
    """Training stopped at a step boundary on a preemption signal, after its checkpoint."""

    exit_code = EXIT_REQUEUE


class PreemptionHandler:
    """Records SIGTERM/SIGUSR1 while installed (a context manager); then restores the previous
    handlers, or ignores those signals from then on if one arrived."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.received: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame) -> None:
        self.received = self.received or signal.Signals(signum)

    def __enter__(self) -> PreemptionHandler:
        self._previous = {s: signal.signal(s, self._record) for s in PREEMPTION_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            # After a preemption the process is on its way out with EXIT_REQUEUE: a repeated
            # signal during the teardown must not turn that into death by signal.
            signal.signal(s, signal.SIG_IGN if self.received else handler)

    def agreed(self) -> bool:
        """Collective: whether any rank received a preemption signal."""
        if not dist.is_initialized():
            return self.received is not None
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([self.received is not None], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stop(self, step: int, checkpoint: Path | None) -> Preempted:
        """The exception that ends training; rank 0 leaves the record `supervise_launch` reads."""
        name = self.received.name if self.received is not None else "a signal on another rank"
        if not dist.is_initialized() or dist.get_rank() == 0:
            record = {"step": step, "checkpoint": str(checkpoint) if checkpoint else None, "signal": name}
            (self.run_dir / PREEMPTED_FILE).write_text(json.dumps(record) + "\n")
        return Preempted(
            f"stopped at step {step} by {name}; checkpoint {checkpoint}; "
            f"exit code {EXIT_REQUEUE} asks the scheduler to requeue"
        )


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Block the preemption signals in this thread (and in processes it starts) for a while.

    Saves run inside it: the helper processes that megatron's checkpoint writer starts (a spawned
    queue manager, forked writers) inherit the mask, so a signal sent to the whole process group
    cannot kill them half-way through a save. The main process still sees the signal, through
    another thread or when the mask is lifted.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def supervise_launch(run_dir: str | Path, launch: Callable[[], int]) -> int:
    """Run a local launcher (torchrun) that may be preempted; EXIT_REQUEUE if its workers were.

    The launcher's parent ignores the signals while it waits: torchrun forwards them to the
    workers (SIGUSR1 too, once named in TORCHELASTIC_SIGNALS_TO_HANDLE) and the workers save.
    torchrun turns any failed worker into exit code 1, so workers that stopped for a preemption
    leave PREEMPTED_FILE in the run directory and this gives 75 back. torchrun SIGKILLs its
    workers a while after forwarding a signal (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default,
    300 s here); a save cut short that way leaves the previous checkpoint in place."""
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")  # time for the workers' save
    record = Path(run_dir) / PREEMPTED_FILE
    record.unlink(missing_ok=True)  # left by an earlier launch
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in PREEMPTION_SIGNALS}
    try:
        code = launch()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if code != 0 and record.is_file():
        return EXIT_REQUEUE
    return code
