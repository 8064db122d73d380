"""One owner per output: a run directory, an eval folder, a results file, an export.

A job that writes into PATH first takes PATH.lock, a file beside it, and holds it for its whole
life; a second job on PATH is refused in one line that names the holder. The lock is an exclusive
flock where the filesystem has one, else (or with SETDIFF_LOCK=lease) a heartbeat lease in the
file. A SLURM requeue of the holder's own job takes the lock over at once; a launcher passes the
lock on to the processes it starts (OWNED_ENV). How it holds on each filesystem:
docs/fault-tolerance.md ("One owner per run").
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from setdiff_megatron.errors import UserError

__all__ = ["OWNED_ENV", "DirectoryLock", "hold", "owned", "release_all", "held_fds"]

OWNED_ENV = "SETDIFF_OWNED"
"""JSON {lock path: token} of the locks an ancestor holds for this process."""
MODE_ENV = "SETDIFF_LOCK"
"""`lease` forces the heartbeat lock where flock is node-local (Lustre `-o localflock`)."""
HEARTBEAT_S = 5.0
"""How often a lease's holder rewrites the heartbeat counter in PATH.lock."""
LEASE_S = float(os.environ.get("SETDIFF_LOCK_LEASE_S", "30"))
"""A lease's holder on another host is gone once its counter has stood still this long (no clocks
are compared); on this host, once its pid is gone."""
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}

_held: dict[Path, DirectoryLock] = {}


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(record: dict) -> bool:
    """Whether the process `record` names still runs (asked only on its own host)."""
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = _start_time(record["pid"])
    return started is None or record.get("started") in (None, started)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _requeued(record: dict) -> bool:
    """The holder is an earlier incarnation of this SLURM job, which SLURM ended before requeueing."""
    job, restart = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
    return job is not None and record.get("slurm_job") == job and record.get("slurm_restart") != restart


def _describe(target: Path, record: dict | None) -> str:
    if record is None:
        return (
            f"{target} is in use by another job (its lock {target}.lock names none); wait for it or choose another path"
        )
    who = (
        f"`{record.get('command', '?')}`, pid {record.get('pid')} on {record.get('host')}, since {record.get('since')}"
    )
    if record.get("host") == socket.gethostname() and not _alive(record):
        return (
            f"{target} is in use by {who}: that process is gone and the processes it started are "
            "still ending; try again in a few seconds"
        )
    return f"{target} is in use by {who}; wait for it to end or stop it, or choose another path"


@dataclass
class DirectoryLock:
    """PATH.lock, held by this process (or an ancestor that passed it on)."""

    target: Path
    fd: int | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    inherited: bool = False
    _beat: threading.Event | None = None

    @property
    def path(self) -> Path:
        return self.target.with_name(self.target.name + ".lock")

    def _record(self, beat: int = 0) -> dict:
        return {
            "command": " ".join(["setdiff", *sys.argv[1:]])[:300],
            "pid": os.getpid(),
            "started": _start_time(os.getpid()),
            "host": socket.gethostname(),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "token": self.token,
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "beat": beat,
        }

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if os.environ.get(MODE_ENV, "flock") != "lease" and self._flock():
                return
            self._lease()
        except OSError as exc:  # a parent that is a file, no permission, a read-only filesystem
            raise UserError(
                f"cannot lock {self.path} for {self.target} ({exc.strerror}); choose another path"
            ) from None

    def _flock(self) -> bool:
        """Take the flock; False where the filesystem has none. The inode is checked after locking:
        a holder that released (unlinked) the file meanwhile leaves a lock on nothing, so try again."""
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _read(self.path)
                os.close(fd)
                if record is not None and _requeued(record):
                    self.path.unlink(missing_ok=True)  # the old incarnation's lock, on a node SLURM lost
                    continue
                raise UserError(_describe(self.target, record)) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in _NO_FLOCK:
                    return False
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(self._record()) + "\n").encode(), 0)
                return True
            os.close(fd)
        raise UserError(f"could not lock {self.path}: other jobs keep taking it; try again")

    def _write(self, beat: int) -> None:
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(self._record(beat)) + "\n")
        partial.replace(self.path)

    def _lease(self) -> None:
        """The heartbeat lock: refuse a live holder, take over a gone one, and confirm after a beat
        that no other contender wrote after us."""
        record = _read(self.path)
        if record is not None and record.get("token") != self.token and not _requeued(record):
            if record.get("host") == socket.gethostname():
                if _alive(record):
                    raise UserError(_describe(self.target, record))
            else:
                time.sleep(LEASE_S)
                if _read(self.path) != record:
                    raise UserError(_describe(self.target, _read(self.path)))
        self._write(0)
        time.sleep(min(1.0, HEARTBEAT_S))
        now = _read(self.path)
        if now is None or now.get("token") != self.token:
            raise UserError(_describe(self.target, now))
        self._beat = threading.Event()
        threading.Thread(target=self._heartbeat, args=(self._beat,), name="setdiff-lock-heartbeat", daemon=True).start()

    def _heartbeat(self, stop: threading.Event) -> None:
        beat = 0
        while not stop.wait(HEARTBEAT_S):
            beat += 1
            record = _read(self.path)
            if record is None or record.get("token") != self.token:
                return  # taken over (a requeue): the new owner's record stays
            self._write(beat)

    def release(self) -> None:
        """Remove the lock file (while still holding it, so a contender retries on a fresh one)."""
        if self.inherited:
            return
        if self._beat is not None:
            self._beat.set()
        record = _read(self.path)
        if record is not None and record.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _inherited(path: Path) -> str | None:
    return json.loads(os.environ.get(OWNED_ENV, "{}")).get(str(path))


def hold(target: str | Path) -> DirectoryLock:
    """Own `target` until `release_all` or the process ends: taken here, or already this
    process's, or passed on by the launcher that started it. A worker of rank > 0 under a launcher
    that holds nothing (plain torchrun, srun) leaves the lock to rank 0."""
    target = Path(target).absolute()
    if target in _held:
        return _held[target]
    lock = DirectoryLock(target)
    token = _inherited(lock.path)
    if token is not None:
        record = _read(lock.path)
        if record is None or record.get("token") != token:
            raise UserError(f"{target}: the lock its launcher took is gone ({lock.path}); start the job again")
        lock.token, lock.inherited = token, True
    elif int(os.environ.get("RANK", "0")) != 0:
        lock.inherited = True
    else:
        lock.acquire()
        owned_now = json.loads(os.environ.get(OWNED_ENV, "{}"))
        os.environ[OWNED_ENV] = json.dumps({**owned_now, str(lock.path): lock.token})
    _held[target] = lock
    return lock


def _forget(lock: DirectoryLock) -> None:
    lock.release()
    _held.pop(lock.target, None)
    owned_now = json.loads(os.environ.get(OWNED_ENV, "{}"))
    if not lock.inherited and owned_now.pop(str(lock.path), None) is not None:
        os.environ[OWNED_ENV] = json.dumps(owned_now)


@contextlib.contextmanager
def owned(target: str | Path) -> Iterator[DirectoryLock]:
    """`hold(target)` for the block (a no-op when the process already holds it)."""
    already = Path(target).absolute() in _held
    lock = hold(target)
    try:
        yield lock
    finally:
        if not already:
            _forget(lock)


def release_all() -> None:
    """Release every lock this process took (the end of a `setdiff` command)."""
    for lock in list(_held.values()):
        _forget(lock)


def held_fds() -> tuple[int, ...]:
    """The flock descriptors this process holds, for the processes it starts to keep open: the
    lock then lasts until the last of them ends, not only this one."""
    return tuple(lock.fd for lock in _held.values() if lock.fd is not None)
