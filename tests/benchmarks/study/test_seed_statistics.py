"""The study's statistics over training seeds (report.over_seeds) on made-up runs whose figures
are worked out by hand, and the committed three-seed results held to them."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.study.report import over_seeds

FULL_RUN = Path(__file__).parents[3] / "benchmarks" / "results" / "study" / "adapted-2026-12-04" / "results.json"


def _run(accuracies: tuple[float, float], tokens_per_step: float, curve: list, levels: dict) -> dict:
    """One seed's entry: two decoding points (W = 1 and W = 4) on 100 problems."""
    points = [
        {"point": f"p{i}", "window": w, "accuracy": a, "examples": 100, "tokens_per_step": t, "tokens_per_s": 10.0 * t}
        | {"mean_nfe": 20 / t, "levels": levels}
        for i, (w, a, t) in enumerate(zip((1, 4), accuracies, (1.0, tokens_per_step)))
    ]
    return {"label": "d = 4", "family": "sd", "recipe": "r.yaml", "steps": 400, "train_minutes": 2.0} | {
        "valid_curve": curve,
        "points": points,
    }


RUNS = {
    1: _run((0.70, 0.50), 2.0, [(100, 3.0), (200, 2.0)], {"1": 1.0, "2": 0.5}),
    2: _run((0.80, 0.60), 2.5, [(100, 4.0), (200, 3.0), (300, 2.5)], {"1": 0.5, "2": 0.5}),
    3: _run((0.90, 0.40), 3.0, [(100, 5.0), (200, 1.0)], {"1": 0.0, "2": None}),
}


def test_mean_spread_and_both_standard_errors_of_made_up_seeds():
    entry = over_seeds(RUNS)
    one, parallel = entry["points"]
    # W = 1: 0.7, 0.8, 0.9: mean 0.8, sample deviation 0.1; W = 4: 0.5, 0.6, 0.4: mean 0.5, 0.1.
    assert one["accuracy"] == pytest.approx(0.8) and one["accuracy_std"] == pytest.approx(0.1)
    assert parallel["accuracy"] == pytest.approx(0.5) and parallel["accuracy_std"] == pytest.approx(0.1)
    assert parallel["accuracy_by_seed"] == [0.5, 0.6, 0.4]
    # The mean's standard error from the seeds, 0.1 / sqrt(3); from 100 problems, sqrt(p (1 - p) / n).
    assert parallel["accuracy_se_seeds"] == pytest.approx(0.1 / math.sqrt(3))
    assert one["accuracy_se_problems"] == pytest.approx(0.04) and parallel["accuracy_se_problems"] == pytest.approx(
        0.05
    )
    assert parallel["tokens_per_step"] == pytest.approx(2.5) and parallel["tokens_per_step_by_seed"] == [2.0, 2.5, 3.0]
    assert parallel["levels"] == pytest.approx({"1": 0.5, "2": 0.5})  # a level a seed lacks is left out
    # The curve at the steps every seed logged; minutes add up; each seed's own figures kept.
    assert entry["valid_curve"] == [(100, pytest.approx(4.0)), (200, pytest.approx(2.0))]
    assert entry["seeds"] == [1, 2, 3] and entry["train_minutes"] == pytest.approx(6.0)
    assert entry["by_seed"]["2"]["points"][1]["accuracy"] == 0.6 and entry["steps"] == 400


def test_one_seed_has_no_spread():
    (one, parallel) = over_seeds({7: RUNS[1]})["points"]
    assert (parallel["accuracy"], parallel["accuracy_std"], parallel["accuracy_se_seeds"]) == (0.5, 0.0, 0.0)


def test_the_committed_three_seed_figures_are_those_statistics_of_their_seeds():
    """benchmarks/results/study/adapted-2026-12-04/results.json, which test_quick.py's bounds come from."""
    model = json.loads(FULL_RUN.read_text())["models"]["sd-d4"]
    assert len(model["points"]) == 4
    for point in model["points"]:
        seeds = point["accuracy_by_seed"]
        assert len(seeds) == 3
        assert point["accuracy"] == pytest.approx(statistics.fmean(seeds))
        assert point["accuracy_std"] == pytest.approx(statistics.stdev(seeds))
        assert point["accuracy_se_seeds"] == pytest.approx(statistics.stdev(seeds) / math.sqrt(3))
        p = point["accuracy"]
        assert point["accuracy_se_problems"] == pytest.approx(math.sqrt(p * (1 - p) / point["examples"]))
        assert point["tokens_per_step"] == pytest.approx(statistics.fmean(point["tokens_per_step_by_seed"]))
