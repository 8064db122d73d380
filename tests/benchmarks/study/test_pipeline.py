"""The study's pipeline end to end on a smoke budget (`--quick --steps 6`, and over two training
seeds): training through the recipes, the sweep, the report. The figures mean nothing at a few
steps; the files and their shape do."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.study.__main__ import main


def test_a_smoke_run_writes_the_tables_and_plots(tmp_path):
    results = main(
        [
            "--quick",
            "--steps",
            "6",
            "--per-level",
            "2",
            "--out",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ]
    )
    assert set(results["models"]) == {"sd-d4"}
    model = results["models"]["sd-d4"]
    assert model["steps"] == 6 and model["valid_curve"][-1][0] == 6 and model["train_minutes"] > 0
    one, parallel = model["points"]
    assert one["examples"] == parallel["examples"] == 10
    assert (one["window"], one["tokens_per_step"]) == (1, 1.0)
    assert (parallel["window"], parallel["threshold"]) == (4, 0.9) and parallel["tokens_per_step"] >= 1.0
    assert 0 < results["trivial_baseline"] <= 1
    written = json.loads((tmp_path / "results" / "results.json").read_text())
    assert written["models"].keys() == results["models"].keys()
    for name in ("results.md", "pareto.png", "loss_curves.png"):
        assert (tmp_path / "results" / name).stat().st_size > 0

    again = main(
        [
            "--quick",
            "--steps",
            "6",
            "--per-level",
            "2",
            "--out",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ]
    )  # a rerun trains and decodes nothing again
    assert again["models"]["sd-d4"]["points"] == results["models"]["sd-d4"]["points"]
    assert again["wall_minutes"] < results["wall_minutes"] / 3


@pytest.mark.slow  # 45 s; the committed three-seed run is what test_quick reads
def test_over_seeds_every_model_trains_per_seed_and_reports_mean_and_spread(tmp_path):
    results = main(
        [
            "--quick",
            "--steps",
            "2",
            "--per-level",
            "1",
            "--seeds",
            "1,2",
            "--out",
            str(tmp_path / "runs"),
            "--results",
            str(tmp_path / "results"),
        ]
    )
    assert results["seeds"]["training"] == [1, 2]
    model = results["models"]["sd-d4"]
    assert model["seeds"] == [1, 2] and set(model["by_seed"]) == {"1", "2"}
    assert sorted(p.name for p in (tmp_path / "runs" / "runs").iterdir()) == ["sd-d4-seed1", "sd-d4-seed2"]
    for point in model["points"]:  # each point's figures over the seeds are those of its per-seed runs
        by_seed = point["accuracy_by_seed"]
        runs = [next(q for q in model["by_seed"][s]["points"] if q["point"] == point["point"]) for s in ("1", "2")]
        assert by_seed == [q["accuracy"] for q in runs] and point["accuracy"] == sum(by_seed) / 2
        assert point["accuracy_std"] == pytest.approx(abs(by_seed[0] - by_seed[1]) / math.sqrt(2))
    assert "± " in (tmp_path / "results" / "results.md").read_text()


def test_the_adapted_setting_starts_every_model_from_the_shipped_base():
    from benchmarks.study import plan
    from setdiff_megatron.recipes import load_recipe

    reasoning, code = plan.models(False, "adapted")
    assert len(reasoning) == 7 and not code
    for model in reasoning:
        recipe = load_recipe(model.recipe)
        assert recipe.model.init_from == "assets/reasoning-ar-base" and recipe.train.steps == 400
        points, grid = model.grid(False)
        assert points[0]["window"] == 1 and not grid and len(points) == (1 if model.family == "ar" else 4)
