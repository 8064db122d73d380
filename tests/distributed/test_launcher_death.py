"""A launcher's death ends what it started, SIGKILL included (child_processes.follow_parent): torchrun
and its workers under every local launcher (workers.Torchrun: train, sample and eval --nproc,
serve), the workers when torchrun itself is killed, and a command started with `child_env`."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.training.leftovers import left_behind

pytestmark = pytest.mark.multiproc

LAUNCHER = """
from setdiff_megatron.distributed.workers import Torchrun
Torchrun(2, [], "tests.distributed.sleeping_worker").run()
"""


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _wait_for_workers(launcher: subprocess.Popen, count: int) -> list[psutil.Process]:
    for _ in range(count):
        assert launcher.stdout.readline().strip() == "worker up"
    [starter] = psutil.Process(launcher.pid).children()  # torchrun, or the command itself
    return starter.children() or [starter]


def _end(launcher: subprocess.Popen) -> None:
    if left_behind(launcher.pid, wait_s=0):
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


@pytest.mark.parametrize("victim", ["launcher", "torchrun"])
def test_killing_the_launcher_or_its_torchrun_ends_every_worker_within_seconds(victim):
    launcher = _start(LAUNCHER)
    try:
        workers = _wait_for_workers(launcher, 2)
        assert len(workers) == 2
        target = launcher.pid if victim == "launcher" else workers[0].ppid()
        os.kill(target, signal.SIGKILL)
        killed = time.monotonic()
        assert not left_behind(launcher.pid, wait_s=20), launcher.stdout.read()
        assert time.monotonic() - killed < 10
    finally:
        _end(launcher)


def test_a_command_started_with_child_env_ends_with_its_parent():
    parent = _start(
        "import subprocess, sys, time\n"
        "from setdiff_megatron.distributed.child_processes import child_env\n"
        "subprocess.Popen([sys.executable, '-m', 'tests.distributed.sleeping_worker'], env=child_env())\n"
        "time.sleep(300)\n"
    )
    try:
        _wait_for_workers(parent, 1)
        os.kill(parent.pid, signal.SIGKILL)
        assert not left_behind(parent.pid, wait_s=10)
    finally:
        _end(parent)
