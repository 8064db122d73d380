"""The committed study results and the report drawn from them: `--report-only` redraws results.md
byte for byte from results.json, and the results name their models as the plan does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.study import plan
from benchmarks.study.__main__ import main
from benchmarks.study.report import markdown, over_seeds, render

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "study"
COMMITTED = ("supervised", "packed", "adapted")
"""The settings whose committed results name their models as the plan does today."""
REPORTS = tuple(sorted(p.name for p in RESULTS.iterdir() if (p / "results.json").is_file()))
"""Every committed report, the earlier runs' (adapted-2026-12-05, ...) included."""


@pytest.mark.parametrize("setting", REPORTS)
def test_the_committed_tables_are_the_report_of_the_committed_json(setting):
    results = json.loads((RESULTS / setting / "results.json").read_text(encoding="utf-8"))
    assert markdown(results) == (RESULTS / setting / "results.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("setting", COMMITTED)
def test_the_committed_results_name_their_models_as_the_plan_does(setting):
    """Keys, labels, families and recipes: a model renamed in the plan is renamed in its results
    (results of a subset of the plan's models, `--models`, hold them in the plan's order)."""
    results = json.loads((RESULTS / setting / "results.json").read_text(encoding="utf-8"))
    reasoning, code = plan.models(False, setting)
    for group, planned in (("models", reasoning), ("code_models", code)):
        # A run may train a subset of the plan (--models): in the plan's order, none outside it.
        planned = [m for m in planned if m.name in results[group]]
        assert list(results[group]) == [m.name for m in planned]
        for m in planned:
            entry = results[group][m.name]
            assert (entry["label"], entry["family"]) == (m.label, m.family)
            if setting != "packed" or m in code:  # the packed run predates recipes/study/packed/
                assert entry["recipe"] == str(m.recipe.relative_to(plan.RECIPES.parents[1]))


def test_report_only_redraws_the_report_and_leaves_the_json_alone(tmp_path):
    shutil.copy(RESULTS / "adapted" / "results.json", tmp_path / "results.json")
    before = (tmp_path / "results.json").read_bytes()
    main(["--setting", "adapted", "--report-only", "--results", str(tmp_path)])
    assert (tmp_path / "results.json").read_bytes() == before
    assert (tmp_path / "results.md").read_bytes() == (RESULTS / "adapted" / "results.md").read_bytes()
    for name in ("pareto.png", "loss_curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [([], "no "), (["--steps", "3"], "drop --steps"), (["--seeds", "1,2"], "drop --seeds")],
)
def test_report_only_refuses_what_it_would_ignore_or_cannot_find(tmp_path, capsys, extra, message):
    if extra:
        shutil.copy(RESULTS / "adapted" / "results.json", tmp_path / "results.json")
    with pytest.raises(SystemExit) as exit_:
        main(["--setting", "adapted", "--report-only", "--results", str(tmp_path), *extra])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "results.md").exists()


def _infill_run(exact: float, invocation: str) -> dict:
    """One seed's entry of the infill setting: made-up scores on 10 chains of two levels."""
    scores = {"exact_match": exact, "rouge1": 0.9, "rouge2": 0.5, "rougeL": 0.8}
    return {"label": "set diffusion d=4", "family": "sd", "recipe": "r.yaml", "steps": 10, "train_minutes": 1.0} | {
        "valid_curve": [(10, 1.0)],
        "points": [],
        "infill_chains": scores
        | {"task": "jsonl", "context": "both", "examples": 10, "skipped_too_long": 0, "decoding": {}}
        | {"tokens_per_step": 1.0, "tokens_per_s": 100.0, "mean_nfe": 8.0, "levels": {"a": exact, "b": 1.0}}
        | {"invocation": invocation},
    }


def test_infill_results_report_the_rules_each_seed_and_the_invocations(tmp_path):
    model = over_seeds({1: _infill_run(0.4, "2026-12-05T01:00:00Z"), 2: _infill_run(0.6, "2026-12-05T02:00:00Z")})
    fill = model["infill_chains"]
    assert fill["exact_match"] == pytest.approx(0.5) and fill["exact_match_std"] == pytest.approx(0.1 * 2**0.5)
    assert fill["levels"] == pytest.approx({"a": 0.5, "b": 1.0}) and fill["exact_match_by_seed"] == [0.4, 0.6]
    rules = {"trivial": 0.01, "left_only": 0.07, "right_context": 1.0, "examples": 10}
    results = {
        "mode": "full",
        "setting": "infill",
        "started": "2026-12-05 02:00 UTC",
        "machine": {"cpu_count": 2},
        "wall_minutes": 1.0,
        "command": "python -m benchmarks.study --setting infill",
        "seeds": {"corpus": 0, "training": [1, 2], "decoding": "greedy"},
        "load_average": {"start": 1.0, "end": 2.0},
        "infill_per_level": 5,
        "infill_baselines": rules | {"by_level": {"a": rules, "b": rules}},
        "models": {"sd-d4": model},
        "code_models": {},
    }
    text = markdown(results)
    assert "| best left-only guess | 0.070 | 0.070 | 0.070 |" in text
    assert "| set diffusion d=4 | both | 0.500 ± 0.141 [0.400, 0.600] |" in text
    assert "measured in 2 invocations of the study (2026-12-05T01:00:00Z, 2026-12-05T02:00:00Z)" in text
    render(results, tmp_path)
    assert (tmp_path / "infill.png").is_file() and not (tmp_path / "pareto.png").exists()
