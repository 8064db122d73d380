"""A run owns its directory (distributed/ownership.py) and its launcher takes its processes with
it (distributed/child_processes.py, `follow_parent`): the two scenarios of a launcher killed with
SIGKILL (what the OOM killer does) and a second `setdiff train` on a directory in use."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from setdiff_megatron.checkpoint.names import find_checkpoints
from tests.cli_runs import setdiff
from tests.training.leftovers import left_behind
from tests.training.test_checkpoint_runs import command, train_args
from tests.training.test_fault_tolerance_runs import snapshot

pytestmark = pytest.mark.multiproc


def _wait_for_checkpoints(run: Path, count: int, launcher: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300
    while len(find_checkpoints(run / "checkpoints")) < count:
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.slow  # 45 s; the lock, the refusal and the launcher's death have their own tests (tests/distributed/test_ownership.py, test_launcher_death.py)
def test_a_second_run_is_refused_and_a_killed_launcher_takes_its_ranks_with_it(data_cache, tmp_path):
    run = tmp_path / "run"
    long_run = (
        "parallel.micro_batch_size=4",
        "train.steps=400",
        "checkpoint.interval=2",
        "checkpoint.keep_last_n=1000",
        "checkpoint.async_save=true",
    )
    log = tmp_path / "first.txt"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            command(run, data_cache, *long_run), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_for_checkpoints(run, 2, launcher, log)
        saved = [c.name for c in find_checkpoints(run / "checkpoints")]
        before = {name: snapshot(run / "checkpoints" / name) for name in saved}

        second = setdiff(*train_args(run, data_cache, *long_run), timeout=300, check=False)
        assert second.returncode == 2, second.stderr[-3000:]
        [line] = second.stderr.strip().splitlines()
        assert f"{run} is in use by `setdiff train" in line and f"pid {launcher.pid} on " in line, line
        assert {name: snapshot(run / "checkpoints" / name) for name in saved} == before

        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert not left_behind(launcher.pid, wait_s=60), log.read_text()[-3000:]
        ended_s = time.monotonic() - killed
        assert ended_s < 30, f"the run's processes took {ended_s:.1f} s to end"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    assert {name: snapshot(run / "checkpoints" / name) for name in saved} == before

    newest = int(find_checkpoints(run / "checkpoints")[0].name.removeprefix("step_"))
    resumed = subprocess.run(
        command(run, data_cache, *long_run, f"train.steps={newest + 2}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{newest:08d}'} at step {newest}" in resumed.stdout
    assert not (run.parent / "run.lock").exists()  # released at the end
