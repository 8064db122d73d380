"""One owner per output (distributed/ownership.py): a second job on a held path is refused in one
line and changes nothing; a lock whose holder is gone, or an earlier incarnation of the same SLURM
job, is taken over; the lease mode does the same where the filesystem has no flock."""

import errno
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from setdiff_megatron.distributed import ownership
from setdiff_megatron.errors import UserError

HOLDER = """
import sys, time
from setdiff_megatron.distributed import ownership
ownership.hold(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in (ownership.OWNED_ENV, ownership.MODE_ENV, "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    ownership.release_all()


def _holder(target: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def _checksums(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_a_second_owner_is_refused_in_one_line_naming_the_first(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "weights").write_bytes(b"saved")
    before = _checksums(run)
    holder = _holder(run)
    try:
        with pytest.raises(UserError) as refused:
            ownership.hold(run)
        message = str(refused.value)
        assert "\n" not in message and f"pid {holder.pid} on {socket.gethostname()}" in message
        assert "in use by" in message and "since" in message and "choose another path" in message
        assert _checksums(run) == before
    finally:
        holder.kill()
        holder.wait()
    ownership.hold(run)  # the kernel dropped the dead holder's flock: taken over, no person needed
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert _checksums(run) == before


def test_a_lock_file_left_by_a_crash_is_taken_and_a_release_removes_it(tmp_path):
    stale = {"pid": 999999, "host": socket.gethostname(), "since": "yesterday", "token": "old", "command": "setdiff"}
    (tmp_path / "out.lock").write_text(json.dumps(stale))
    with ownership.owned(tmp_path / "out") as lock:
        assert json.loads(lock.path.read_text())["token"] == lock.token
        with ownership.owned(tmp_path / "out"):  # the same process again: already its own
            pass
        assert lock.path.exists()
    assert not (tmp_path / "out.lock").exists()


def test_a_requeued_slurm_job_takes_over_its_earlier_incarnations_lock(tmp_path, monkeypatch):
    run = tmp_path / "run"
    holder = _holder(run, {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "0"})
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "42")  # another job: refused
        with pytest.raises(UserError, match="in use by"):
            ownership.hold(run)
        monkeypatch.setenv("SLURM_JOB_ID", "41")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the same job, requeued (its old node lost)
        lock = ownership.hold(run)
        assert json.loads(lock.path.read_text())["slurm_restart"] == "1"
    finally:
        holder.kill()
        holder.wait()


def test_workers_find_their_launchers_lock_theirs_and_rank_one_leaves_it_to_rank_zero(tmp_path, monkeypatch):
    lock = ownership.hold(tmp_path / "run")
    inherited = subprocess.run(
        [sys.executable, "-c", "from setdiff_megatron.distributed import ownership as o; import sys; "
         "print(o.hold(sys.argv[1]).inherited)", str(tmp_path / "run")],
        capture_output=True, text=True, env=dict(os.environ), pass_fds=ownership.held_fds(),
    )  # fmt: skip
    assert inherited.stdout.strip() == "True", inherited.stderr
    ownership.release_all()
    assert not lock.path.exists()
    monkeypatch.setenv("RANK", "1")
    assert ownership.hold(tmp_path / "run").inherited and not lock.path.exists()


def test_without_flock_the_lease_refuses_a_live_holder_and_takes_a_gone_one(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")  # Lustre mounted noflock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(ownership, "HEARTBEAT_S", 0.2)
    live = {"pid": os.getppid(), "host": socket.gethostname(), "since": "now", "token": "other", "command": "setdiff"}
    (tmp_path / "run.lock").write_text(json.dumps(live))
    with pytest.raises(UserError, match=f"pid {os.getppid()}"):
        ownership.hold(tmp_path / "run")
    (tmp_path / "run.lock").write_text(json.dumps({**live, "pid": 999999}))  # on this host, gone
    lock = ownership.hold(tmp_path / "run")
    beat = json.loads(lock.path.read_text())["beat"]
    time.sleep(0.7)
    assert json.loads(lock.path.read_text())["beat"] > beat  # the heartbeat moves
    ownership.release_all()
    assert not lock.path.exists()


def test_the_lease_reads_another_hosts_holder_by_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setenv(ownership.MODE_ENV, "lease")
    monkeypatch.setattr(ownership, "LEASE_S", 0.3)
    still = {"pid": 1, "host": "node-7", "since": "then", "token": "other", "command": "setdiff", "beat": 4}
    (tmp_path / "run.lock").write_text(json.dumps(still))
    real_sleep = time.sleep

    def beating(seconds):  # the other host's holder writes a beat while we watch
        real_sleep(seconds)
        (tmp_path / "run.lock").write_text(json.dumps({**still, "beat": 5}))

    monkeypatch.setattr(ownership.time, "sleep", beating)
    with pytest.raises(UserError, match="node-7"):
        ownership.hold(tmp_path / "run")
    monkeypatch.setattr(ownership.time, "sleep", real_sleep)
    assert ownership.hold(tmp_path / "run").token != "other"  # its beat stood still for the lease


@pytest.mark.parametrize(
    "command",
    [
        "sample SRC --prompts P --out OUT",
        "sample SRC --prompts P --out OUT --nproc 2",
        "eval generate SRC --tasks P --metric exact --out OUT",
        "eval likelihood SRC --data P --out OUT",
        "eval infill SRC --task jsonl --data P --out OUT",
        "eval sweep recipes/eval/sweep-tiny.yaml --out OUT",
        "convert to-hf SRC OUT --overwrite",
        "convert from-hf SRC OUT --overwrite",
    ],
)
def test_every_command_that_writes_an_output_owns_it(tmp_path, capsys, command):
    from setdiff_megatron.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.jsonl").write_text("saved\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "reference": "b", "text": "a b"}\n')
    argv = command.replace("SRC", str(tmp_path / "model")).replace("P", str(tmp_path / "p.jsonl"))
    holder = _holder(out)
    try:
        assert main(argv.replace("OUT", str(out)).split()) == 2
    finally:
        holder.kill()
        holder.wait()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{out} is in use by" in line and f"pid {holder.pid}" in line
    assert (out / "kept.jsonl").read_text() == "saved\n" and sorted(p.name for p in out.iterdir()) == ["kept.jsonl"]


def test_a_shard_of_an_array_job_owns_only_its_shard(tmp_path):
    holder = _holder(Path(f"{tmp_path / 'out'}.shard-0-of-2"))
    try:
        ownership.hold(f"{tmp_path / 'out'}.shard-1-of-2")
        with pytest.raises(UserError, match="in use by"):
            ownership.hold(f"{tmp_path / 'out'}.shard-0-of-2")
    finally:
        holder.kill()
        holder.wait()


def test_a_path_that_cannot_hold_a_lock_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match=r"^cannot lock .*a-file/run.lock .*choose another path$"):
        ownership.hold(tmp_path / "a-file" / "run")
