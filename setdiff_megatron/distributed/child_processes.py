"""The processes a rank starts, ended with it: checkpoint writers, their workers, helper managers.

megatron-core's checkpoint save starts processes of its own (a spawned manager, forked writers
and workers), which a rank that ends without Python's exit handlers (the watchdog's `os._exit`, a
SIGKILL) would leave running, re-parented to PID 1, one more set per torchrun restart. So every
process forked once `ChildProcesses` exists, and every manager `start_manager` spawns, exits when its
parent is gone; `ChildProcesses.end` stops them on every way out that runs Python, and
`ChildProcesses.kill` is the watchdog's last act. docs/fault-tolerance.md ("What survives what").
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable
from multiprocessing.managers import SyncManager

import psutil

__all__ = ["ChildProcesses", "start_manager", "exit_with_parent", "follow_parent", "child_env", "PARENT_ENV"]

PARENT_POLL_S = 0.5
"""How often an orphan-to-be looks for its parent."""
PARENT_ENV = "SETDIFF_PARENT_PID"
"""Set by a process for the commands it starts (workers.Torchrun, the study's runs): the pid they
end with."""
GRACE_S = 30.0
"""How long a command whose parent is gone has to stop as a preempted run does, before it exits."""

_managers: list[tuple[SyncManager, int]] = []
"""The managers `start_manager` started in this process, with their pids."""
_forks_watched = False
_pid_before_fork = 0


def exit_with_parent(parent: int, *, grace_s: float = 0.0) -> None:
    """End this process (exit code 1) once `parent` is no longer its parent: a daemon thread polls
    `os.getppid()` (as torch's DataLoader workers do), which changes the moment the parent dies and
    the process is re-parented. With `grace_s` it first sends itself SIGTERM, the signal a run
    stops on with a checkpoint (and torchrun on by stopping its workers), and exits only if that
    has not ended it in time."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        if grace_s:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="setdiff-exit-with-parent", daemon=True).start()


def follow_parent() -> None:
    """End this command with the process that started it, however that one ends (SIGKILL too).

    A torchrun worker follows its torchrun and exits at once: torchrun is gone only if it was
    killed outright, and then so is the job. A command started with PARENT_ENV (torchrun under
    a `setdiff` launcher, a study's run) follows that pid and stops as a preempted run does."""
    if "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_parent(os.getppid())
    elif PARENT_ENV in os.environ:
        parent = int(os.environ.pop(PARENT_ENV))
        if os.getppid() != parent:  # gone before this process got here
            os._exit(1)
        exit_with_parent(parent, grace_s=GRACE_S)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment (`env`, default this process's) for a `setdiff` command this process starts
    and that must end with it (`follow_parent`)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def _remember_pid() -> None:
    global _pid_before_fork
    _pid_before_fork = os.getpid()


def _watch_forks() -> None:
    """From now on every process forked here (and from those, since the hook is inherited) exits
    with its parent; the pid is taken before the fork, so a parent dead by the time the child runs
    still counts."""
    global _forks_watched
    if not _forks_watched:
        os.register_at_fork(before=_remember_pid, after_in_child=lambda: exit_with_parent(_pid_before_fork))
        _forks_watched = True


def _start_helper(parent: int, ignored: tuple[int, ...], pid_to) -> None:
    """A manager's start in its own process: ignore `ignored` signals, exit with `parent`, report
    its pid through the pipe end `pid_to`."""
    for s in ignored:
        signal.signal(s, signal.SIG_IGN)
    exit_with_parent(parent)
    pid_to.send(os.getpid())
    pid_to.close()


def start_manager(ignore: Iterable[int] = ()) -> SyncManager:
    """A SyncManager in a spawned process that ignores the signals `ignore`, exits with this
    process, and is shut down by `ChildProcesses.end`."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    manager = SyncManager(ctx=ctx)
    manager.start(initializer=_start_helper, initargs=(os.getpid(), tuple(ignore), send))
    send.close()
    _managers.append((manager, receive.recv()))
    receive.close()
    return manager


def _gone(p: psutil.Process) -> bool:
    """Ended (a zombie waits only for its parent to read its exit status)."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(procs: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """Those of `procs` still running after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in procs if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


class ChildProcesses:
    """The processes this one starts from now on, children and theirs: a caller's own earlier
    children are not the run's to end."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._before = set(self._me.children(recursive=True))
        _watch_forks()

    def alive(self) -> list[psutil.Process]:
        """Every process started since, still running, but multiprocessing's resource tracker,
        which exits by itself once the last process holding its pipe is gone."""
        found = []
        for p in self._me.children(recursive=True):
            try:
                if p in self._before or _gone(p) or "multiprocessing.resource_tracker" in " ".join(p.cmdline()):
                    continue
            except psutil.NoSuchProcess:
                continue
            found.append(p)
        return found

    def end(self, wait_s: float = 5.0) -> None:
        """Terminate the writers and anything else (SIGTERM; a writer that blocks it, as a save's
        do, gets `wait_s` to finish its files), then kill what is left; then shut the managers
        down, last, so no writer finds its results queue gone."""
        managers = {pid for _, pid in _managers}
        others = [p for p in self.alive() if p.pid not in managers]
        _signal(others, signal.SIGTERM)
        _signal(_wait(others, wait_s), signal.SIGKILL)
        while _managers:
            manager, _ = _managers.pop()
            manager.shutdown()  # multiprocessing's: a bounded wait, then terminate, then kill
        self.kill()

    def kill(self) -> None:
        """SIGKILL every process started since, at once (the watchdog's last act before `os._exit`:
        nothing waits)."""
        _signal(self.alive(), signal.SIGKILL)
