"""kill -9 at random moments of saving, trial after trial: `resume: auto` must always load a
complete checkpoint, never a partial one, and never one older than the last save that finished;
synchronous saves, and background ones (checkpoint.async_save: killed while megatron's forked
writers are writing, or while the checkpoint is being published).

Each trial starts the two ranks of checkpoint_fault_worker.py. They resume (checking what they
loaded against fingerprints taken before the save), then save after every synthetic step. At a
random moment within the saves one rank gets SIGKILL, then, a moment later, the rest of the
process group (a node failure, then the scheduler's cleanup). The next trial's `RESUMED` step
must be the newest checkpoint this test finds complete by itself (sizes and sha256).

    SETDIFF_FAULT_TRIALS=50 python -m pytest tests/training/test_checkpoint_faults.py -m slow -s
"""

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.checkpoint.names import find_checkpoints
from setdiff_megatron.distributed.runtime import free_port

WORKER = str(Path(__file__).with_name("checkpoint_fault_worker.py"))
TRIALS = int(os.environ.get("SETDIFF_FAULT_TRIALS", "3"))  # CI runs 3 a mode (about 40 s); a soak, 50


def start_ranks(run_dir: Path, logs: list[Path], mode: str) -> list[subprocess.Popen]:
    """Two ranks in one new process group, so a group kill also takes their helper processes."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    procs: list[subprocess.Popen] = []
    for rank, log in enumerate(logs):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-u", WORKER, str(run_dir), mode],
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                process_group=0 if rank == 0 else procs[0].pid,
            )
        )
    return procs


def events(log: Path) -> list[tuple[str, int]]:
    words = (line.split() for line in log.read_text().splitlines())
    return [(w[0], int(w[1])) for w in words if len(w) == 2 and w[0] in ("RESUMED", "SAVING", "SAVED", "MISMATCH")]


def wait_for(log: Path, kinds: set[str], procs: list[subprocess.Popen], nth: int = 1) -> tuple[str, int]:
    """The nth event of one of these kinds in a rank's log, once it is there."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = [e for e in events(log) if e[0] in kinds]
        if len(found) >= nth:
            return found[nth - 1]
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a rank exited early:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"no {kinds} in {log} after 300 s")


def newest_complete(root: Path) -> int:
    return next((int(p.name[5:]) for p in find_checkpoints(root) if verify(p) is None), 0)


def phase(root: Path) -> str:
    """Where the save stood when the processes died, read from what they left on disk."""
    partial = list(root.glob("step_*.tmp"))
    if partial:
        return "manifest written, not renamed" if (partial[0] / "manifest.json").is_file() else "writing shards"
    published = find_checkpoints(root)
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    if published and published[0].name != latest:
        return "renamed, latest not updated"
    return "between saves or in retention"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_while_saving_never_leaves_a_partial_checkpoint_to_resume(tmp_path, mode):
    rng, run, root = random.Random(1234), tmp_path / "run", tmp_path / "run" / "checkpoints"
    last_saved, phases = 0, collections.Counter()
    for trial in range(TRIALS + 1):
        expected = newest_complete(root)
        logs = [tmp_path / f"trial{trial:02d}.rank{r}.log" for r in range(2)]
        procs = start_ranks(run, logs, mode)
        try:
            kind, step = wait_for(logs[0], {"RESUMED", "MISMATCH"}, procs)
            assert kind == "RESUMED", f"trial {trial}: loaded state differs from its fingerprint at step {step}"
            assert step == expected and step >= last_saved, (trial, step, expected, last_saved)
            if trial == TRIALS:
                break
            wait_for(logs[0], {"SAVED"}, procs)  # the first save also starts megatron's helper process
            start = time.monotonic()
            wait_for(logs[0], {"SAVED"}, procs, nth=2)
            time.sleep(rng.uniform(0, 2 * (time.monotonic() - start)))  # saves fill ~95% of the loop
            rng.choice(procs).kill()
            time.sleep(rng.uniform(0, 0.3))
        finally:
            os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.wait()
        phases[phase(root)] += 1
        last_saved = max([last_saved] + [s for log in logs for k, s in events(log) if k == "SAVED"])
    print(
        f"\n{TRIALS} kill -9 trials ({mode} saves), each resumed from the newest complete checkpoint; "
        f"where the kills landed: {dict(phases)}"
    )
    assert sum(phases.values()) == TRIALS
