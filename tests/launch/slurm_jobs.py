"""Watching SLURM jobs from a test: state, waiting with a deadline, cleanup."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).parents[2]
TINY = REPO / "recipes" / "tiny-cpu.yaml"


def isolated_env(config_home: Path, **extra: str) -> dict[str, str]:
    """This environment, without a cluster file, with this checkout first on PYTHONPATH: jobs
    inherit sbatch's environment, so they run this checkout's `setdiff`."""
    env = {k: v for k, v in os.environ.items() if k != "SETDIFF_CLUSTER_FILE"}
    env["XDG_CONFIG_HOME"] = str(config_home)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**env, **extra}


def job(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Reason, ...); {} once it is gone."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    fields = {}
    for item in out.stdout.split():
        key, _, value = item.partition("=")
        fields.setdefault(key, value)
    return fields


def wait_until(job_id: str, done, *, timeout: float, what: str, log: Path | None = None) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job(job_id)
        if done(state):
            return state
        time.sleep(1)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else "(no log)"
    raise AssertionError(f"job {job_id}: not {what} after {timeout:.0f}s: {job(job_id)}\n--- log tail ---\n{tail}")


def finished(state: dict[str, str]) -> bool:
    return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for_file_line(path: Path, predicate, *, timeout: float, job_id: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(predicate(line) for line in path.read_text().splitlines()):
            return
        if finished(job(job_id)):
            break
        time.sleep(0.5)
    raise AssertionError(f"job {job_id}: {path} never had the expected line; job: {job(job_id)}")


def cancel(job_id: str) -> None:
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def losses(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, metric) -> value of the train and validation losses in a run's metrics.jsonl."""
    curve = {}
    for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key in ("train/loss", "valid/loss"):
            if key in record:
                curve[(record["step"], key)] = record[key]
    return curve
