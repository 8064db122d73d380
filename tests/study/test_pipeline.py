"""The study's pipeline end to end on a smoke budget (`--quick --steps 6`): training through the
recipes, the sweep, the report. The figures mean nothing at 6 steps; the files and their shape do."""

from __future__ import annotations

import json

from benchmarks.study.__main__ import main


def test_a_smoke_run_writes_the_tables_and_plots(tmp_path):
    results = main(["--quick", "--steps", "6", "--per-level", "2", "--out", str(tmp_path / "runs"),
                    "--results", str(tmp_path / "results")])
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

    again = main(["--quick", "--steps", "6", "--per-level", "2", "--out", str(tmp_path / "runs"),
                  "--results", str(tmp_path / "results")])  # a rerun trains and decodes nothing again
    assert again["models"]["sd-d4"]["points"] == results["models"]["sd-d4"]["points"]
    assert again["wall_minutes"] < results["wall_minutes"] / 3
