"""`python -m benchmarks.study --quick --setting adapted --seeds 4`: set diffusion d = 4 adapted
from the shipped AR base with the full study's recipe (400 steps), decoded on its 250 test
problems at W = 1 and at the paper's default policy (W = 4, threshold 0.9); 8.0 minutes on 2 cores
shared with other work (2026-12-05), its training 4.1 of them.

The thresholds are read from the full run over training seeds 1, 2 and 3
(benchmarks/results/study/adapted-2026-12-04/results.json, the run before the baselines), as the seed mean less SPREADS standard
deviations of the seeds. The run here trains seed 4, none of those, so it checks that a new seed
keeps the trade-off, not that one of the three is reproduced. Three seeds estimate a spread
poorly (with two degrees of freedom the true deviation may be four times the measured one), and
another CPU's float order moves a run about as far as another seed does, so the margin is wide;
it still sits far above what a model that has not learned the task scores (the trivial baseline
is 0.036). The seeds 1-3 measured 2026-12-04: accuracy 0.585 +- 0.018 (bound 0.495), 2.49 +- 0.02
tokens per step (bound 2.39), and 0.092 +- 0.028 lost to parallel decoding against W = 1 (bound
0.23). Seed 4 measured 2026-12-05: 0.604, 2.48 tokens per step, 0.048 lost (0.652 at W = 1)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks.study import plan
from benchmarks.study.__main__ import main

FULL_RUN = Path(__file__).parents[3] / "benchmarks" / "results" / "study" / "adapted-2026-12-04" / "results.json"
SPREADS = 5
SEED = 4
"""The quick run's training seed: outside the seeds the bounds come from."""


def _point(model: dict, **decoding) -> dict:
    (point,) = [p for p in model["points"] if all(p[key] == value for key, value in decoding.items())]
    return point


def _bounds() -> dict[str, float]:
    """Lowest accuracy and tokens per step, highest cost of parallel decoding, from the seeds."""
    model = json.loads(FULL_RUN.read_text())["models"]["sd-d4"]
    one, parallel = _point(model, window=1), _point(model, **plan.QUICK_POINT)
    costs = [a - b for a, b in zip(one["accuracy_by_seed"], parallel["accuracy_by_seed"])]

    def low(values: list[float]) -> float:
        return statistics.mean(values) - SPREADS * statistics.stdev(values)

    return {
        "accuracy": low(parallel["accuracy_by_seed"]),
        "tokens_per_step": low(parallel["tokens_per_step_by_seed"]),
        "cost": statistics.mean(costs) + SPREADS * statistics.stdev(costs),
    }


def test_the_bounds_come_from_three_seeds_and_mean_something():
    model = json.loads(FULL_RUN.read_text())["models"]["sd-d4"]
    assert model["seeds"] == [1, 2, 3] and SEED not in model["seeds"]
    bounds = _bounds()
    assert bounds["accuracy"] > 10 * json.loads(FULL_RUN.read_text())["trivial_baseline"]
    assert bounds["tokens_per_step"] > 2.0 and bounds["cost"] < 0.25


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_study_keeps_the_full_runs_trade_off(tmp_path):
    bounds = _bounds()
    results = main(
        [
            "--quick",
            "--setting",
            "adapted",
            "--seeds",
            str(SEED),
            "--out",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ]
    )
    model = results["models"]["sd-d4"]
    one, parallel = _point(model, window=1), _point(model, **plan.QUICK_POINT)
    assert one["examples"] == parallel["examples"] == 250
    assert parallel["accuracy"] >= bounds["accuracy"]
    assert parallel["tokens_per_step"] >= bounds["tokens_per_step"]
    assert one["accuracy"] - parallel["accuracy"] <= bounds["cost"]
    assert (tmp_path / "results" / "results.md").is_file()
