"""What a run leaves running: the processes of its session (a run started with
start_new_session=True is the leader of a session its ranks, their checkpoint writers and
managers all inherit, whoever re-parents them)."""

import os
import time

import psutil


def left_behind(session: int, wait_s: float = 15.0) -> list[str]:
    """The command lines of session `session`'s processes still running after up to `wait_s`: a
    helper whose rank died takes up to a second to notice, the resource tracker a moment more."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if os.getsid(p.pid) == session and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(p.info["cmdline"] or []))
            except (ProcessLookupError, PermissionError):
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
