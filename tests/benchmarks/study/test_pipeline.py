"""The study's pipeline end to end on a smoke budget (`--quick --steps 2` over two training
seeds): training through the recipes, the sweep, the report. The figures mean nothing at a few
steps; the files and their shape do."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.study.__main__ import main


@pytest.mark.slow  # two trainings and decodes, then a rerun that does neither
def test_a_smoke_run_over_two_seeds_writes_the_tables_and_plots(tmp_path):
    """Each seed's run trains and decodes; every point's figures over the seeds are those of its
    per-seed runs; the tables and plots are written; a rerun trains and decodes nothing again."""
    argv = ["--quick", "--steps", "2", "--per-level", "1", "--seeds", "1,2"]
    argv += ["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    results = main(argv)
    assert set(results["models"]) == {"sd-d4"} and results["seeds"]["training"] == [1, 2]
    model = results["models"]["sd-d4"]
    assert model["seeds"] == [1, 2] and set(model["by_seed"]) == {"1", "2"}
    assert sorted(p.name for p in (tmp_path / "runs" / "runs").iterdir()) == ["sd-d4-seed1", "sd-d4-seed2"]
    assert model["steps"] == 2 and model["valid_curve"][-1][0] == 2 and model["train_minutes"] > 0
    one, parallel = model["points"]
    assert one["examples"] == parallel["examples"] == 5
    assert (one["window"], one["tokens_per_step"]) == (1, 1.0)
    assert (parallel["window"], parallel["threshold"]) == (4, 0.9) and parallel["tokens_per_step"] >= 1.0
    for point in model["points"]:  # each point's figures over the seeds are those of its per-seed runs
        by_seed = point["accuracy_by_seed"]
        runs = [next(q for q in model["by_seed"][s]["points"] if q["point"] == point["point"]) for s in ("1", "2")]
        assert by_seed == [q["accuracy"] for q in runs] and point["accuracy"] == sum(by_seed) / 2
        assert point["accuracy_std"] == pytest.approx(abs(by_seed[0] - by_seed[1]) / math.sqrt(2))
    assert 0 < results["trivial_baseline"] <= 1
    written = json.loads((tmp_path / "results" / "results.json").read_text())
    assert written["models"].keys() == results["models"].keys()
    for name in ("results.md", "pareto.png", "loss_curves.png"):
        assert (tmp_path / "results" / name).stat().st_size > 0
    assert "± " in (tmp_path / "results" / "results.md").read_text()

    again = main(argv)  # a rerun trains and decodes nothing again
    assert again["models"]["sd-d4"]["points"] == results["models"]["sd-d4"]["points"]
    assert again["wall_minutes"] < results["wall_minutes"] / 3


def test_the_adapted_setting_starts_every_model_from_the_shipped_base():
    from benchmarks.study import plan
    from setdiff_megatron.recipes import load_recipe

    reasoning, code = plan.models(False, "adapted")
    assert len(reasoning) == 10 and not code
    for model in reasoning:
        recipe = load_recipe(model.recipe)
        assert recipe.model.init_from == "assets/reasoning-ar-base" and recipe.train.steps == plan.ADAPTED_STEPS
        points, grid = model.grid(False)
        assert not grid and len(points) == {"ar": 1, "mdlm": 12, "bd3lm": 10}.get(model.family, 6)


def test_the_baselines_are_the_papers_families_under_the_settings_budget():
    """MDLM and BD3-LM train as `method.family` says, with the same data, steps and optimizer as
    the setting's set diffusion models; they sweep the threshold over their blocks, their paper
    default (threshold 0.9) among the points, with their blocks placed both ways."""
    from benchmarks.study import plan
    from setdiff_megatron.recipes import load_recipe

    for setting in ("supervised", "adapted"):
        models = {m.name: m for m in plan.models(False, setting)[0]}
        reference = load_recipe(models["sd-d4"].recipe)
        for name, family, block in (("mdlm", "mdlm", None), ("bd3lm-b4", "bd3lm", 4), ("bd3lm-b8", "bd3lm", 8)):
            recipe = load_recipe(models[name].recipe)
            assert (recipe.method.family, recipe.method.block_size) == (family, block)
            for section in ("data", "train", "parallel"):
                assert getattr(recipe, section) == getattr(reference, section)
            assert recipe.model == reference.model
            points, _ = models[name].grid(False)
            block = block or plan.MDLM_BLOCK
            assert {p["name"] for p in points} >= {f"b{block}-toff", f"b{block}-t0.9", f"b{block}-t0.5"}
            # every point under both block placements, the paper's (unaligned) unsuffixed
            placements = {p["name"]: p["align_inputs_to_blocks"] for p in points}
            assert placements[f"b{block}-t0.9"] is False and placements[f"b{block}-t0.9-aligned"] is True
            assert sorted(placements.values()).count(True) == len(points) // 2
            assert models[name].decoding_defaults() == {"block_size": block}
    assert not {m.name for m in plan.models(False, "packed")[0]} & set(plan.BASELINES)


def test_the_infill_setting_pretrains_every_family_on_the_chains():
    from benchmarks.study import plan
    from setdiff_megatron.recipes import load_recipe

    models = plan.models(False, "infill")[0]
    assert [m.name for m in models] == list(plan.INFILL_MODELS)
    contexts = {}
    for m in models:
        recipe = load_recipe(m.recipe)
        assert [d.path for d in recipe.data.datasets] == [
            "reasoning-chains"
        ] and recipe.data.seq_len == plan.INFILL_LENGTH
        assert recipe.data.datasets[0].format == "pretraining" and recipe.model.init_from is None
        contexts[m.name] = m.infills()
    assert contexts["ar"] == {"": {"context": "left", "window": 1}}
    assert contexts["sd-d4"] == contexts["sd-d16"] == {"": {"context": "both", "window": 16}}
    assert contexts["mdlm"] == {"": {"context": "both", "window": 64, "block_size": 64}}
    blocks = {"context": "blocks", "window": 4, "block_size": 4}  # BD3-LM as the reference, then its own blocks'
    assert contexts["bd3lm-b4"] == {"": blocks | {"context": "both", "cache_infill_input": True}, "blocks": blocks}


def test_the_budget_setting_reuses_the_adapted_runs_at_their_budget():
    from benchmarks.study import plan
    from benchmarks.study.run import overrides

    models = plan.models(False, "budget", (400, 1600))[0]
    assert [m.key for m in models] == [
        *plan.BUDGET_MODELS,
        *(f"{name}-steps1600" for name in plan.BUDGET_MODELS),
    ]
    assert {m.setting for m in models} == {"adapted"} and models[0].recipe == plan.models(False, "adapted")[0][0].recipe
    longer = replace(models[-1], seed=2)
    assert longer.key == "bd3lm-b4-steps1600-seed2" and longer.group == "bd3lm-b4-steps1600"
    assert "train.steps=1600" in overrides(Path("out"), longer, None)
    assert overrides(Path("out"), longer, 3)[-2:] == ["train.steps=3", "checkpoint.interval=3"]  # a smoke run's


@pytest.mark.slow  # 80 s on 2 cores (2026-12-07): every baseline point under both block placements
def test_the_baselines_run_through_the_pipeline(tmp_path):
    """MDLM and BD3-LM train through their recipes and decode every point of their sweeps, each
    point's speed with the invocation that measured it, their blocks placed both ways; --merge
    puts one model's entry into the results again, recording the invocation that did."""
    argv = ["--models", "mdlm,bd3lm-b4", "--steps", "2", "--per-level", "1", "--out", str(tmp_path / "runs")]
    trained = main([*argv, "--train-only", "--results", str(tmp_path / "results")])
    assert trained == {"trained": ["mdlm", "bd3lm-b4"]} and not (tmp_path / "results").exists()
    results = main([*argv, "--results", str(tmp_path / "results")])
    assert list(results["models"]) == ["mdlm", "bd3lm-b4"]
    for name, block in (("mdlm", 32), ("bd3lm-b4", 4)):
        points = results["models"][name]["points"]
        assert [p["point"] for p in points][:5] == [f"b{block}-t{t}" for t in ("off", "0.99", "0.9", "0.7", "0.5")]
        assert {p["block_size"] for p in points[:5]} == {block} and all(p["examples"] == 5 for p in points)
        assert {p["invocation"] for p in points} == {results["invocation"]} and all(p["tokens_per_s"] for p in points)
        assert [p["align_inputs_to_blocks"] for p in points] == [p["point"].endswith("-aligned") for p in points]
        assert len(points) == 2 * (6 if name == "mdlm" else 5)
    assert results["models"]["mdlm"]["points"][5]["block_size"] == 8
    text = (tmp_path / "results" / "results.md").read_text()
    assert "| BD3-LM (block 4) | b4-t0.9 | - | 0.9 |" in text and "measured in one invocation" in text
    merged = main([*argv, "--merge", "--models", "bd3lm-b4", "--results", str(tmp_path / "results")])
    assert list(merged["models"]) == ["mdlm", "bd3lm-b4"] and merged["invocation"] == results["invocation"]
    assert [m["models"] for m in merged["merges"]] == [["bd3lm-b4"]]
    assert "Merged in later: bd3lm-b4" in (tmp_path / "results" / "results.md").read_text()
    with pytest.raises(SystemExit):
        main([*argv, "--merge", "--models", "mdlm", "--results", str(tmp_path / "elsewhere")])


@pytest.mark.slow  # about a minute on 2 cores: four models trained and infilled, one seed (the seeds' handling
# is test_a_smoke_run_over_two_seeds_writes_the_tables_and_plots's)
def test_the_infill_setting_runs_through_the_pipeline(tmp_path):
    """An infill model of each context (left; both; both over blocks, its input cached; blocks)
    trains on the chains, infills them, and the rules' figures, per-level scores and speeds reach
    the results. (Set diffusion d = 8 and d = 16 infill as d = 4 does, with another recipe.)"""
    argv = ["--setting", "infill", "--steps", "2", "--infill-per-level", "2", "--seeds", "1"]
    argv += ["--models", "ar,sd-d4,mdlm,bd3lm-b4"]
    results = main([*argv, "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")])
    assert results["infill_baselines"]["right_context"] == 1.0 and results["infill_baselines"]["examples"] == 10
    contexts = {name: m["infill_chains"]["context"] for name, m in results["models"].items()}
    assert contexts == {"ar": "left", "sd-d4": "both", "mdlm": "both", "bd3lm-b4": "both"}
    bd3lm = results["models"]["bd3lm-b4"]
    assert (
        bd3lm["infill_chains"]["decoding"]["cache_infill_input"]
        and bd3lm["infill_chains_blocks"]["context"] == "blocks"
    )
    for r in [m["infill_chains"] for m in results["models"].values()] + [bd3lm["infill_chains_blocks"]]:
        assert r["examples"] == 10 and len(r["exact_match_by_seed"]) == 1 and r["tokens_per_s"] > 0
        assert set(r["levels"]) == set(results["infill_baselines"]["by_level"])
    text = (tmp_path / "results" / "results.md").read_text()
    assert "| BD3-LM (block 4) | both, input cached |" in text and "| BD3-LM (block 4), blocks | blocks |" in text
    assert (tmp_path / "results" / "infill.png").stat().st_size > 0


def _run_file(directory: Path, key: str, group: str, seed: int, accuracy: float) -> None:
    point = {"point": "w1", "accuracy": accuracy, "examples": 4, "tokens_per_step": 1.0, "tokens_per_s": 10.0}
    point |= {"mean_nfe": 4.0, "levels": {"ops2-d1": accuracy}, "invocation": f"i{seed}", "per_problem": [1.0] * 4}
    entry = {"label": "set diffusion d=4, 6400 steps", "family": "sd", "recipe": "r.yaml", "steps": 6400}
    entry |= {"seed": seed, "group": group, "train_minutes": 60.0, "valid_curve": [[0, 4.0], [6400, 0.01 * seed]]}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{key}.json").write_text(json.dumps(entry | {"points": [point], "commit": "abc"}))


def test_run_files_written_in_pieces_make_the_settings_entries(tmp_path, capsys):
    """--per-run: each run's file, written by whichever sitting trained it, joins its group over
    seeds; an earlier whole invocation's models stay as they were measured."""
    from benchmarks.study.__main__ import _models_from_run_files, _parser, _with_run_files

    runs = tmp_path / "runs"
    _run_file(runs, "sd-d4-steps6400-seed1", "sd-d4-steps6400", 1, 0.5)
    _run_file(runs, "sd-d4-steps6400-seed2", "sd-d4-steps6400", 2, 0.7)
    models = _models_from_run_files(tmp_path, seeded=True)
    (entry,) = models.values()
    assert entry["seeds"] == [1, 2] and entry["points"][0]["accuracy_by_seed"] == [0.5, 0.7]
    assert entry["points"][0]["invocation_by_seed"] == ["i1", "i2"] and "per_problem" not in entry["points"][0]
    earlier = {"setting": "budget", "budgets": [400, 1600], "seeds": {"training": [1, 2, 3]}, "models": {"ar": {}}}
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    args = _parser().parse_args(["--setting", "budget", "--budgets", "6400", "--seeds", "1,2", "--per-run"])
    results = _with_run_files(tmp_path, args, models, {"invocation": "now"}, {"budgets": [6400]})
    assert list(results["models"]) == ["ar", "sd-d4-steps6400"] and results["budgets"] == [400, 1600, 6400]
    assert results["seeds"]["training"] == [1, 2, 3] and results["per_run"] == [
        {"models": ["sd-d4-steps6400"], "invocation": "now"}
    ]
    with pytest.raises(SystemExit):
        main(["--setting", "packed", "--per-run"])
    assert "--per-run" in capsys.readouterr().err
