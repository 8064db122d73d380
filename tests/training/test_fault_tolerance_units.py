"""The parts of fault tolerance that need no training run: the spike rule, the drill
specifications of SETDIFF_INJECT, the hang watchdog in a process of its own, the straggler
rule, and the recipe keys."""

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from setdiff_megatron.distributed.fault_injection import Faults
from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.recipes.validation import validate_recipe
from setdiff_megatron.training import stragglers
from setdiff_megatron.training.spikes import SpikeDetector
from setdiff_megatron.training.watchdog import EXIT_HANG

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


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("explode:step=1", "unknown fault 'explode'"),
        ("kill:rank=1", "needs step=N"),
        ("hang:step=x", "cannot read 'step=x'"),
    ],
)
def test_a_bad_drill_is_one_line(monkeypatch, spec, fragment):
    monkeypatch.setenv("SETDIFF_INJECT", spec)
    with pytest.raises(UserError, match=fragment):
        Faults.from_env(rank=0)


def test_the_watchdog_names_rank_step_and_frame_and_exits_for_a_restart(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from setdiff_megatron.training.watchdog import Watchdog
        with Watchdog(1.0, 3, Path({str(tmp_path)!r}), poll_s=0.1) as dog:
            dog.beat(7)
            time.sleep(60)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_HANG, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("setdiff: rank 3: no progress for ") and "at step 7" in line and "<module>" in line, line
    assert "Thread" in (tmp_path / "hang-rank3.txt").read_text()


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
