"""The unconditional setting (claim 1 on unconditional generation): its models and points, the
entropy that catches repetition, the figures over seeds, and the pipeline end to end on a smoke
budget (the figures mean nothing at 2 steps; the files and their shape do)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.study import plan, report, unconditional
from benchmarks.study.__main__ import main
from setdiff_megatron.recipes import load_recipe


def test_the_models_are_the_papers_families_pretrained_on_packed_windows():
    models, code = plan.models(False, "unconditional")
    assert [m.name for m in models] == list(plan.UNCONDITIONAL_MODELS) and not code
    for m in [*models, unconditional.JUDGE]:
        recipe = load_recipe(m.recipe)
        assert [d.format for d in recipe.data.datasets] == ["pretraining"], m.name
        assert (recipe.model.hidden_size, recipe.model.num_layers) == (128, 4)
    judge, ar = load_recipe(unconditional.JUDGE.recipe), load_recipe(models[0].recipe)
    assert judge.train.steps == 4 * ar.train.steps and judge.method.order == "left_to_right"


def test_each_family_samples_one_token_per_step_and_in_parallel():
    by_name = {m.name: m for m in plan.models(False, "unconditional")[0]}
    assert [p["point"] for p in unconditional.points(by_name["ar"])] == ["ar"]
    sd = unconditional.points(by_name["sd-d4"])
    assert sd[0] == {"point": "w1", "window": 1} and {p["window"] for p in sd[1:]} == {4, 8}
    assert [p["point"] for p in unconditional.points(by_name["bd3lm-b4"])] == [
        "b4-toff",
        "b4-t0.9",
        "b4-t0.7",
        "b4-t0.5",
    ]
    assert {p["block_size"] for p in unconditional.points(by_name["mdlm"])} == {32}


def test_the_unigram_entropy_falls_where_a_sample_repeats_itself():
    assert unconditional.unigram_entropy("aaaa") == 0.0
    assert unconditional.unigram_entropy("abab") == pytest.approx(math.log(2))
    assert unconditional.unigram_entropy("12+3=15") > unconditional.unigram_entropy("11+1=11")


def _run(perplexity: float, entropy: float) -> dict:
    point = {"point": "w1", "window": 1, "samples": 4, "empty": 1, "judge_nll": math.log(perplexity)}
    point |= {"judge_perplexity": perplexity, "entropy": entropy, "mean_length": 20.0, "tokens_per_step": 1.0}
    point |= {"tokens_per_s": 10.0, "mean_nfe": 20.0, "invocation": "i"}
    entry = {"label": "d=4", "family": "sd", "recipe": "r.yaml", "steps": 2, "train_minutes": 1.0}
    return entry | {"valid_curve": [(2, 5.0)], "points": [], "generation": [point]}


def test_the_figures_over_seeds_are_the_runs_figures():
    over = report.over_seeds({1: _run(10.0, 2.0), 2: _run(12.0, 2.2)})
    (point,) = over["generation"]
    assert point["judge_perplexity"] == 11.0 and point["judge_perplexity_by_seed"] == [10.0, 12.0]
    assert point["judge_perplexity_std"] == pytest.approx(math.sqrt(2))
    assert point["entropy"] == pytest.approx(2.1) and (point["samples"], point["empty"]) == (8, 2)
    assert set(over["by_seed"]["1"]) >= {"generation", "valid_curve"}


@pytest.mark.slow  # about 2 minutes on 2 cores: two models and the judge trained 2 steps, sampled and judged
def test_the_unconditional_setting_runs_through_the_pipeline(tmp_path):
    argv = ["--setting", "unconditional", "--steps", "2", "--samples", "3", "--per-level", "1"]
    argv += ["--models", "sd-d4,mdlm", "--seeds", "1"]
    results = main([*argv, "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")])
    assert results["seeds"]["decoding"] == unconditional.SAMPLING and results["samples"] == 3
    assert 1.0 < results["reference"]["judge_perplexity"] and results["reference"]["documents"] == 3
    assert (tmp_path / "runs" / "runs" / "ar-judge" / "checkpoints").is_dir()
    models = {m.name: m for m in plan.models(False, "unconditional")[0]}
    for name in ("sd-d4", "mdlm"):
        points = results["models"][name]["generation"]
        assert [p["point"] for p in points] == [p["point"] for p in unconditional.points(models[name])]
        for p in points:
            assert p["samples"] == 3 and p["judge_perplexity"] > 1.0 and p["entropy"] > 0.0
            assert p["tokens_per_step"] > 0 and p["invocation_by_seed"] == [results["invocation"]]
    text = (tmp_path / "results" / "results.md").read_text()
    assert "| held-out documents (3) |" in text and "| set diffusion d=4 | w4-t0.9 | 4 | 0.9 |" in text
    assert (tmp_path / "results" / "pareto.png").stat().st_size > 0
    assert json.loads((tmp_path / "results" / "results.json").read_text())["setting"] == "unconditional"
