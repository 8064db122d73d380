"""The committed study results and the report drawn from them: `--report-only` redraws results.md
byte for byte from results.json, and the results name their models as the plan does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.study import plan
from benchmarks.study.__main__ import main
from benchmarks.study.report import markdown

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "study"


@pytest.mark.parametrize("setting", plan.SETTINGS)
def test_the_committed_tables_are_the_report_of_the_committed_json(setting):
    results = json.loads((RESULTS / setting / "results.json").read_text(encoding="utf-8"))
    assert markdown(results) == (RESULTS / setting / "results.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("setting", plan.SETTINGS)
def test_the_committed_results_name_their_models_as_the_plan_does(setting):
    """Keys, labels, families and recipes: a model renamed in the plan is renamed in its results."""
    results = json.loads((RESULTS / setting / "results.json").read_text(encoding="utf-8"))
    reasoning, code = plan.models(False, setting)
    for group, planned in (("models", reasoning), ("code_models", code)):
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
