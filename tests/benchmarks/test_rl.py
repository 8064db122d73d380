"""The RL evidence's arithmetic and its committed report (benchmarks/rl.py; the runs themselves are
the slow tests/test_main_job.py::test_the_rl_benchmark_measures_every_variant_and_reuses_its_runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.rl import markdown, paired_change

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "rl"


def test_the_change_is_paired_problem_by_problem():
    before = [1.0, 0.0, 1.0, 0.0]
    change = paired_change(before, [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    assert change["mean"] == pytest.approx(0.25)  # per problem: 0, +0.5, 0, +0.5
    assert change["se_problems"] == pytest.approx(0.5 / 3**0.5 / 2)  # their stdev over sqrt(4)


def test_the_committed_report_is_what_its_results_give():
    results = json.loads((RESULTS / "results.json").read_text())
    assert markdown(results) == (RESULTS / "results.md").read_text()
    assert results["seeds"] == [1, 2, 3] and set(results["variants"]) == {"exact", "one_step", "lora"}
    for variant in results["variants"].values():
        assert sorted(variant["by_seed"]) == ["1", "2", "3"]  # every seed's figures kept
