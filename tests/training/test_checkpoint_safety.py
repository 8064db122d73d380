"""Nothing saved is ever lost: real `setdiff train` runs over run directories whose checkpoints
are damaged, all invalid, or about to be saved again.

Each test copies a finished 4-step run (checkpoints at steps 2 and 4), damages it, hashes every
file, runs the command, and then checks the exit code, the message, and the hashes: every file
that existed before is still there with the same sha256, at its own path or inside the directory
it was moved aside to (`step_N.<why>-<time>`). The exceptions are the files a training command is
told to change: `checkpoints/latest` (it names the newest checkpoint), the run's `recipe.yaml`
(the resolved recipe of the latest launch; every checkpoint keeps its own copy) and the logs,
which only grow.
"""

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.checkpoint.test_run_directory import flip_a_byte, truncate
from tests.training.test_checkpoint_runs import checkpoint_of, losses, run_train

pytestmark = pytest.mark.multiproc

ARGS = ("launch.nproc_per_node=1", "checkpoint.interval=2", "checkpoint.keep_last_n=null")
TOLD_TO_CHANGE = ("checkpoints/latest", "recipe.yaml")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_cache):
    """(run directory, the finished process): stdout and stderr were pipes, as in a SLURM job."""
    run = tmp_path_factory.mktemp("safety") / "run"
    out = run_train(run, data_cache, *ARGS, "train.steps=4", "log.interval=2")
    assert out.returncode == 0, out.stderr[-3000:]
    return run, out


@pytest.fixture
def run(finished, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished[0], copy)
    return copy


def test_off_a_terminal_progress_is_plain_lines(finished):
    """No carriage returns anywhere; a line per log.interval with step/total, loss, LR, grad norm,
    tokens/s, elapsed and ETA; the preprocessing and sampling progress in lines too."""
    _, out = finished
    assert "\r" not in out.stdout + out.stderr
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ") and " | loss " in line]
    assert [line.split(" | ")[0] for line in steps] == ["step 2/4", "step 4/4"]
    for part in ("loss ", "lr ", "grad norm ", "tokens/s ", "elapsed "):
        assert all(part in line for line in steps), (part, steps)
    assert "ETA " in steps[0] and "ETA " not in steps[1]


def hashes(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def assert_kept(before: dict[str, str], run: Path) -> list[str]:
    """Every file of `before` unchanged, in place or moved aside with its checkpoint (the told-to
    files excepted; logs may only grow). Returns the names of the directories moved aside."""
    after = hashes(run)
    aside = sorted(
        {
            rel.split("/")[1]
            for rel in after
            if rel.startswith("checkpoints/") and "-" in rel.split("/")[1] and "." in rel.split("/")[1]
        }
    )
    for rel, digest in before.items():
        if rel in TOLD_TO_CHANGE:
            continue
        if rel.startswith("logs/"):
            assert rel in after, f"{rel} was deleted"
            continue
        parts = rel.split("/")
        moved = [f"checkpoints/{a}/{'/'.join(parts[2:])}" for a in aside if a.split(".")[0] == parts[1]]
        assert after.get(rel) == digest or any(after.get(m) == digest for m in moved), f"{rel} changed or vanished"
    return aside


def test_a_damaged_train_state_is_skipped_reported_and_moved_aside(run, data_cache):
    flip_a_byte(checkpoint_of(run, 4) / "train_state.json")
    before = hashes(run)
    out = run_train(run, data_cache, *ARGS, "train.steps=6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"setdiff: skipping checkpoint {checkpoint_of(run, 4)}: " in out.stdout
    assert "train_state.json does not match its sha256" in out.stdout
    assert f"resumed from {checkpoint_of(run, 2)} at step 2" in out.stdout
    aside = assert_kept(before, run)
    assert [a.split(".")[0] for a in aside] == ["step_00000004"] and "moved" in out.stdout
    assert (checkpoint_of(run, 6) / "manifest.json").is_file() and (checkpoint_of(run, 4) / "manifest.json").is_file()


def test_a_damaged_shard_is_skipped_and_kept(run, data_cache):
    shard = sorted(checkpoint_of(run, 4).glob("*.distcp"))[0]
    truncate(shard)
    before = hashes(run)
    out = run_train(run, data_cache, *ARGS, "train.steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"setdiff: skipping checkpoint {checkpoint_of(run, 4)}: {shard} has 100 bytes" in out.stdout
    assert [a.split(".")[0] for a in assert_kept(before, run)] == ["step_00000004"]


def test_a_missing_manifest_is_skipped_and_kept(run, data_cache):
    (checkpoint_of(run, 4) / "manifest.json").unlink()
    before = hashes(run)
    out = run_train(run, data_cache, *ARGS, "train.steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "manifest.json is missing (an interrupted save?)" in out.stdout
    assert [a.split(".")[0] for a in assert_kept(before, run)] == ["step_00000004"]


def test_all_invalid_stops_with_one_line_then_resume_none_starts_over(run, data_cache):
    for step in (2, 4):  # the weights intact, every train_state.json damaged
        (checkpoint_of(run, step) / "train_state.json").write_text("{")
    before = hashes(run)
    out = run_train(run, data_cache, *ARGS, "train.steps=6")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("setdiff: error:")]
    assert line.startswith(f"setdiff: error: checkpoint.dir {run} holds checkpoints, and none can be resumed")
    assert line.index("(step_00000004: ") < line.index("; step_00000002: ") < line.index("checkpoint.resume=none")
    assert hashes(run) == before  # nothing at all was written

    out = run_train(run, data_cache, *ARGS, "train.steps=2", "checkpoint.resume=none")
    assert out.returncode == 0, out.stderr[-3000:]
    aside = assert_kept(before, run)
    assert sorted(a.split(".")[0] for a in aside) == ["step_00000002", "step_00000004"]
    assert all(".aside-" in a for a in aside) and (checkpoint_of(run, 2) / "manifest.json").is_file()


def test_a_mix_resumes_from_the_newest_valid_and_leaves_older_invalid_ones_alone(run, data_cache):
    truncate(sorted(checkpoint_of(run, 2).glob("*.distcp"))[0])
    before = hashes(run)
    out = run_train(run, data_cache, *ARGS, "train.steps=6")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {checkpoint_of(run, 4)} at step 4" in out.stdout and "skipping" not in out.stdout
    assert assert_kept(before, run) == []
    assert losses(run)[-1][0] == 6


def test_a_re_save_of_an_existing_step_moves_the_old_one_aside(run, data_cache):
    before = hashes(run)
    out = run_train(run, data_cache, *ARGS, "train.steps=4", f"checkpoint.resume={checkpoint_of(run, 2)}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {checkpoint_of(run, 2)} at step 2" in out.stdout
    aside = assert_kept(before, run)
    assert [a.split(".")[0] for a in aside] == ["step_00000004"] and ".replaced-" in aside[0]


def test_two_processes_over_all_damaged_checkpoints_are_refused_once_before_they_start(
    trained_run, data_cache, tmp_path
):
    """The 2-process launch refuses before torchrun: its message once on stderr (no rank's
    copy, no third-party warning, no launcher report), exit code 2, not a file touched."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    for step in (run / "checkpoints").glob("step_*"):
        flip_a_byte(sorted(step.glob("*.distcp"))[0])
    before = hashes(run)
    out = run_train(run, data_cache, "parallel.tp=2", "train.steps=22")
    assert out.returncode == 2 and out.stdout == "", out.stderr[-3000:]
    (line,) = out.stderr.splitlines()
    assert line.startswith(
        f"setdiff: error: checkpoint.dir {run} holds checkpoints, and none can be resumed (step_00000020: "
    )
    assert "does not match its sha256" in line and "checkpoint.resume=none" in line
    assert hashes(run) == before
