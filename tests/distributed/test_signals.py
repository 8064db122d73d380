"""Preemption signals: recorded, agreed on, blocked during saves, and turned into exit code 75."""

import json
import os
import signal
import subprocess
import sys

import pytest

from setdiff_megatron.distributed import signals


@pytest.fixture
def restore_handlers():
    previous = {s: signal.getsignal(s) for s in signals.PREEMPTION_SIGNALS}
    yield
    for s, handler in previous.items():
        signal.signal(s, handler)


def test_preemption_handler_records_and_restores(tmp_path, restore_handlers):
    before = signal.getsignal(signal.SIGTERM)
    with signals.PreemptionHandler(tmp_path) as quiet:
        assert not quiet.agreed()
    assert signal.getsignal(signal.SIGTERM) is before
    with signals.PreemptionHandler(tmp_path) as handler:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still the first one on record
        assert handler.agreed() and handler.received is signal.SIGUSR1
        stop = handler.stop(7, tmp_path / "step_00000007")
    # the process is exiting with EXIT_REQUEUE now: later signals are ignored, not fatal
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert stop.exit_code == signals.EXIT_REQUEUE == 75 and "stopped at step 7 by SIGUSR1" in str(stop)
    assert json.loads((tmp_path / signals.PREEMPTED_FILE).read_text())["step"] == 7


def test_signals_stay_pending_during_a_save_and_child_processes_inherit_the_block(tmp_path, restore_handlers):
    probe = "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
    with signals.PreemptionHandler(tmp_path) as handler:
        with signals.blocked():
            os.kill(os.getpid(), signal.SIGTERM)
            child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        assert handler.received is signal.SIGTERM
    blocked_in_child = json.loads(child.stdout)
    assert all(int(s) in blocked_in_child for s in signals.PREEMPTION_SIGNALS)


def test_supervised_launch_reports_a_preempted_worker_as_75(tmp_path, restore_handlers):
    def preempted_workers() -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # the whole process group is signalled: the parent waits on
        (tmp_path / signals.PREEMPTED_FILE).write_text("{}")
        return 1  # what torchrun reports for any failed worker

    assert signals.supervise_launch(tmp_path, preempted_workers) == signals.EXIT_REQUEUE
    assert signals.supervise_launch(tmp_path, lambda: 1) == 1  # the earlier launch's record is gone
