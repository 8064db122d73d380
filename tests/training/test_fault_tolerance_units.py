"""The parts of fault tolerance that need no training run: the spike rule, the drill
specifications of SETDIFF_INJECT, the hang watchdog's phases in a process of their own, the
processes a rank leaves behind however it ends, the straggler rule, and the recipe keys."""

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from setdiff_megatron.distributed.fault_injection import Faults
from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.recipes.validation import validate_recipe
from setdiff_megatron.training import stragglers
from setdiff_megatron.training.spikes import SpikeDetector
from setdiff_megatron.training.watchdog import EVALUATION, EXIT_HANG, ROLLBACK, SAVE, Watchdog, phase_timeouts
from tests.training.leftovers import left_behind

RECIPES = Path(__file__).parents[2] / "recipes"


def test_a_falling_noisy_curve_has_no_spike_and_a_jump_is_one():
    detector, rng = SpikeDetector(window=50, threshold=6.0, min_history=20), random.Random(0)
    for step in range(500):
        loss = 5.0 * 0.995**step + rng.gauss(0, 0.05)
        assert detector.check(loss) is None, step
        detector.accept(loss)
    spike = detector.check(3.0)
    assert spike is not None and spike.loss == 3.0 and "robust deviations above the recent median" in spike.describe()
    assert detector.check(3.0) is not None  # a spike that was not accepted does not widen the window


def test_no_judgement_before_min_history():
    detector = SpikeDetector(window=10, threshold=3.0, min_history=5)
    for loss in (1.0, 1.0, 1.0, 1.0):
        detector.accept(loss)
    assert detector.check(100.0) is None
    detector.accept(1.0)
    assert detector.check(100.0) is not None
    assert detector.check(1.005) is None  # within the floor of 1 % of the median on a flat curve


def test_drills_fire_as_specified(monkeypatch):
    monkeypatch.setenv(
        "SETDIFF_INJECT",
        "spike:step=3:factor=10,spike:step=5:factor=2:always,slow:rank=1:seconds=0,kill:step=9:attempt=1",
    )
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    faults = Faults.from_env(rank=0)
    assert [faults.loss(3, 1.0), faults.loss(3, 1.0)] == [10.0, 1.0]  # once
    assert [faults.loss(5, 1.0), faults.loss(5, 1.0)] == [2.0, 2.0]  # always
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = Faults.from_env(rank=1)
    assert sorted(f.kind for f in restarted.faults) == ["kill", "slow", "spike"]  # the one-off spike was attempt 0's
    assert [f.kind for f in faults.faults if not f.always] == ["spike"]  # the kill waits for attempt 1


def test_save_drills_fire_inside_the_save_only(monkeypatch):
    monkeypatch.setenv("SETDIFF_INJECT", "hang:step=5:seconds=0:at=save,hang:step=5:seconds=0")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    faults = Faults.from_env(rank=0)
    in_save, at_start = faults.faults
    faults.in_save(4)
    faults.at_step_start(5)
    assert (in_save.fired, at_start.fired) == (False, True)
    faults.in_save(5)
    assert in_save.fired


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("explode:step=1", "unknown fault 'explode'"),
        ("kill:rank=1", "needs step=N"),
        ("hang:step=x", "cannot read 'step=x'"),
        ("hang:step=3:at=eval", "cannot read 'at=eval'"),
        ("spike:step=3:factor=2:at=save", "only kill and hang fire inside a save"),
    ],
)
def test_a_bad_drill_is_one_line(monkeypatch, spec, fragment):
    monkeypatch.setenv("SETDIFF_INJECT", spec)
    with pytest.raises(UserError, match=fragment):
        Faults.from_env(rank=0)


def test_each_phase_has_its_timeout_and_its_name(tmp_path):
    dog = Watchdog(dict(hang_timeout_s=10, save_timeout_s=40, eval_timeout_s=15, startup_timeout_s=30), 0, tmp_path)

    def overdue_after(seconds: float) -> str | None:  # not entered: no thread, the clock read by hand
        return dog.overdue(time.monotonic() + seconds)

    assert overdue_after(25) is None
    assert re.match(
        r"no progress for 3\d s in the start-up \(process groups, data, model build, resume\) "
        r"\(train.startup_timeout_s = 30\)$",
        overdue_after(35),
    )
    dog.beat(1)  # the first step may take the start-up's time
    assert overdue_after(25) is None
    assert "in step 1, the first since the start-up (train.startup_timeout_s = 30)" in overdue_after(35)
    dog.beat(2)
    assert overdue_after(5) is None and "in step 2 (train.hang_timeout_s = 10)" in overdue_after(15)
    with dog.phase(SAVE, 2):  # a save past the step's timeout goes on
        assert overdue_after(35) is None
        assert "in the checkpoint save of step 2 (train.save_timeout_s = 40)" in overdue_after(45)
    assert overdue_after(5) is None and "in step 2 (" in overdue_after(15)  # back in step 2, its clock restarted
    with dog.phase(EVALUATION, 2):
        assert "in the evaluation at step 2 (train.eval_timeout_s = 15)" in overdue_after(20)
    with dog.phase(ROLLBACK, 3):
        assert "in the rollback reload at step 3 (train.save_timeout_s = 40)" in overdue_after(45)
    dog.timeouts["hang_timeout_s"] = 0.0
    assert overdue_after(1e6) is None  # 0: unwatched


TIMEOUTS = dict(hang_timeout_s=1.0, save_timeout_s=4.0, eval_timeout_s=1.0, startup_timeout_s=4.0)


def test_a_slow_save_goes_on_and_a_hung_one_ends_the_process_for_a_restart(tmp_path):
    script = f"""
import time
from pathlib import Path
from setdiff_megatron.training.watchdog import SAVE, Watchdog
with Watchdog({TIMEOUTS!r}, 3, Path({str(tmp_path)!r}), poll_s=0.05) as dog:
    dog.beat(4)
    dog.beat(5)
    with dog.phase(SAVE, 5):
        time.sleep(2)
    print("saved 5", flush=True)
    dog.beat(6)
    with dog.phase(SAVE, 6):
        time.sleep(60)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_HANG and out.stdout == "saved 5\n", out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert re.match(
        r"setdiff: rank 3: no progress for \d+ s in the checkpoint save of step 6 \(train.save_timeout_s = 4\), "
        r"stuck in <module> .*exiting with code 76",
        line,
    ), line
    assert "Thread" in (tmp_path / "hang-rank3.txt").read_text()


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], dict(hang_timeout_s=1800, save_timeout_s=7200, eval_timeout_s=7200, startup_timeout_s=7200)),
        # 8 global batches of validation samples take eight steps' time at most (forward passes only).
        (
            ["parallel.global_batch_size=64", "eval.batches=8", "train.hang_timeout_s=10"],
            dict(hang_timeout_s=10, save_timeout_s=40, eval_timeout_s=80, startup_timeout_s=40),
        ),
        (
            ["train.hang_timeout_s=0", "train.save_timeout_s=600"],
            dict(hang_timeout_s=0, save_timeout_s=600, eval_timeout_s=0, startup_timeout_s=0),
        ),
    ],
)
def test_phase_timeouts_follow_the_step_timeout_unless_set(overrides, expected):
    recipe = load_recipe(RECIPES / "tiny-cpu.yaml", overrides)
    assert phase_timeouts(recipe) == expected


@pytest.mark.parametrize("way, code", [("end", 0), ("error", 1), ("watchdog", EXIT_HANG), ("killed", -signal.SIGKILL)])
def test_a_rank_leaves_no_process_behind_however_it_ends(tmp_path, way, code):
    """A save's manager, writer and the writer's worker are gone once their rank is, whether it
    returned, raised, was ended by the watchdog or was SIGKILLed."""
    rank, out, err = Path(__file__).with_name("helper_processes_rank.py"), tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:  # files: a process left behind holds no pipe open
        proc = subprocess.Popen(
            [sys.executable, str(rank), way, str(tmp_path)], stdout=stdout, stderr=stderr, start_new_session=True
        )
        assert proc.wait(timeout=120) == code, err.read_text()
    assert out.read_text() == "started 3\n", err.read_text()
    assert not left_behind(proc.pid)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("train.spike_policy.min_history=200", "train.spike_policy.min_history: 200 exceeds"),
        ("train.straggler_factor=0.5", "train.straggler_factor"),
    ],
)
def test_fault_tolerance_keys_are_checked(override, fragment):
    recipe = load_recipe(RECIPES / "tiny-cpu.yaml", [override])
    assert any(fragment in e for e in validate_recipe(recipe, world_size=2, has_gpu=False))


def test_skipping_a_spike_under_zero_is_refused():
    recipe = load_recipe(RECIPES / "tiny-cpu-deepspeed.yaml", ["train.spike_policy.action=skip"])
    assert any("use action rollback" in e for e in validate_recipe(recipe, world_size=2, has_gpu=False))


@pytest.mark.parametrize(
    "times, named", [([1.0, 1.6], 1), ([1.0, 1.4], None), ([2.0, 0.9, 1.0, 1.1], 0), ([1.0, 1.0, 1.0, 1.4], None)]
)
def test_a_straggler_is_measured_against_the_other_ranks(monkeypatch, times, named):
    """With two ranks the median of all is their mean, which would hide a rank 1.6x slower than
    the other; the rule compares the slowest rank to the median of the rest."""
    monitor = stragglers.StragglerMonitor(1.5)
    monitor.add(0.0)
    monkeypatch.setattr(stragglers.runtime, "gather_objects", lambda mine: times)
    metrics, warning = monitor.report()
    assert metrics["ranks/slowest"] == times.index(max(times)) and metrics["ranks/compute_s"] == times
    assert (warning is None) == (named is None)
    if named is not None:
        assert warning.startswith(f"rank {named} is a straggler")
