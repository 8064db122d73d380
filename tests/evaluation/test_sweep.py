"""`setdiff eval sweep`: a 3-point grid on the tiny trained checkpoint (one JSONL row per point,
a Pareto plot, AR at one token per step), per-point resumption, the Pareto frontier, and
one-line errors on bad specs."""

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import yaml

from setdiff_megatron.cli import main
from setdiff_megatron.evaluation.records import WandbConfig, log_to_wandb
from setdiff_megatron.evaluation.sweep import load_spec, pareto_front, run_sweep
from setdiff_megatron.inference.sharding import Placement
from tests.cli_runs import setdiff

EXAMPLE = Path(__file__).parents[2] / "recipes" / "eval" / "sweep-tiny.yaml"
ROW_FIELDS = {
    "checkpoint",
    "source",
    "point",
    "decoding",
    "task",
    "metric",
    "score_name",
    "score",
    "quality",
    "tokens_per_s",
    "tokens_per_step",
    "mean_nfe",
    "num_examples",
    "num_tokens",
    "batch_size",
    "hardware",
    "dir",
}


@pytest.fixture(scope="module")
def sweep(trained_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    (tmp / "tasks.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"prompt": "def main(", "reference": "):"},
                {"prompt": "import os\n", "reference": ["import sys", "import re"]},
                {"prompt": "x = 1\n", "reference": "y = 2"},
            ]
        )
    )
    spec = {
        "task": str(tmp / "tasks.jsonl"),
        "metric": "rouge",
        "checkpoints": {"tiny": str(trained_run)},
        "out": str(tmp / "out"),
        "batch_size": 3,
        # over the checkpoint's own policy (its order's threshold 0.9), which null turns off
        "decoding": {"max_new_tokens": 6, "temperature": 1.0, "seed": 1, "threshold": None},
        "points": [{"name": "ar", "window": 1}, {"window": 4}, {"window": 4, "threshold": 0.5}],
    }
    (tmp / "spec.yaml").write_text(yaml.safe_dump(spec))
    return tmp, run_sweep(tmp / "spec.yaml", placement=Placement(progress=False))


@pytest.mark.multiproc
def test_one_row_per_point_with_a_plot(sweep):
    tmp, rows = sweep
    assert [r["point"] for r in rows] == ["ar", "w4", "w4-t0.5"]
    assert [json.loads(line) for line in (tmp / "out" / "sweep.jsonl").read_text().splitlines()] == rows
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["tokens_per_s"] > 0 and row["mean_nfe"] > 0 and row["batch_size"] == 3
        assert row["hardware"]["device"] == "cpu" and set(row["quality"]) == {"rouge1", "rouge2", "rougeL"}
        assert row["score"] == row["quality"]["rougeL"] and row["num_examples"] == 3
    assert [(r["decoding"]["window"], r["decoding"]["threshold"]) for r in rows] == [(1, None), (4, None), (4, 0.5)]
    assert rows[0]["tokens_per_step"] == 1.0 and rows[0]["mean_nfe"] == 7.0  # AR: prefill + 6 steps of one token
    assert rows[1]["tokens_per_step"] == 1.0  # k = 1 and no threshold: one token per step, out of order
    png = (tmp / "out" / "pareto.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.multiproc
def test_finished_points_are_skipped(sweep, capsys):
    tmp, rows = sweep
    shutil.rmtree(tmp / "out" / "points" / "tiny" / "w4")  # as if the job died during this point
    again = run_sweep(tmp / "spec.yaml", placement=Placement(progress=False))
    err = capsys.readouterr().err
    assert err.count("is up to date") == 2 and "wrote 3 results" in err
    timing = ("tokens_per_s",)
    assert [{k: v for k, v in r.items() if k not in timing} for r in again] == [
        {k: v for k, v in r.items() if k not in timing} for r in rows
    ]
    assert [r["tokens_per_s"] for r in again][::2] == [r["tokens_per_s"] for r in rows][::2]


def test_pareto_front():
    #         0    1    2    3    4
    speed = [1.0, 2.0, 3.0, 2.0, 0.5]
    score = [0.9, 0.8, 0.5, 0.7, 0.9]
    assert pareto_front(speed, score) == [0, 1, 2]  # 3 is beaten by 1, 4 by 0


def test_a_grid_over_every_setting_names_each_point_by_its_settings():
    """Each decoding setting names its part of a point (sampling/decoding.py `Setting.short`): a
    setting added there is named in sweeps too, and no two points share a name."""
    from setdiff_megatron.evaluation.sweep import SweepSpec, expand_points
    from setdiff_megatron.sampling.decoding import SETTINGS, DecodingConfig

    default = DecodingConfig()
    other = {bool: lambda v: not v, int: lambda v: 2 if v != 2 else 3, float: lambda v: 0.5 if v != 0.5 else 0.25}
    grid = {key: [getattr(default, key), other[s.kind](getattr(default, key))] for key, s in SETTINGS.items()}
    names = [p.name for p in expand_points(SweepSpec.model_validate({**BASE, "points": [], "grid": grid}))]
    assert len(names) == len(set(names)) == 2 ** len(SETTINGS)
    assert {"w16", "toff", "fill", "span", "unaligned", "aligned", "cache", "nocache"} <= set(
        "-".join(names).split("-")
    )


def test_the_example_spec_loads():
    spec = load_spec(EXAMPLE)
    assert spec.metric == "rouge" and (EXAMPLE.parents[2] / spec.task).is_file()


def sweep_cli(capsys, spec: Path) -> tuple[int, str]:
    code = main(["eval", "sweep", str(spec), "--dry-run"])
    return code, capsys.readouterr().err


BASE = {"task": "t.jsonl", "metric": "exact", "checkpoints": {"a": "run"}, "out": "o", "points": [{"window": 1}]}


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"windw": 4}, "spec.yaml: windw: unknown key; allowed: task, metric"),
        ({"points": [{"window": 4, "treshold": 0.5}]}, "spec.yaml: points.0.treshold: unknown key; allowed: window,"),
        ({"points": []}, "spec.yaml: the sweep has no points: give 'points'"),
        ({"points": [], "grid": {"window": []}}, "spec.yaml: grid.window: expected a non-empty list of values"),
        ({"grid": {"widow": [1]}}, "spec.yaml: grid.widow: unknown setting; allowed: window,"),
        ({"metric": "bleu"}, "spec.yaml: metric: Input should be 'exact', 'rouge' or 'gsm8k' (got 'bleu')"),
        ({"points": [{"window": 0}]}, "spec.yaml: points.0.window: must be >= 1 (got 0)"),
        (
            {"points": [{"window": 4, "threshold": 1.5}]},
            "spec.yaml: points.0.threshold: must be in (0, 1], or None for off (got 1.5)",
        ),
        ({"points": [{"window": 4}, {"window": 4}]}, "two points are named 'w4'"),
        ({"checkpoints": {}}, "spec.yaml: checkpoints: Dictionary should have at least 1 item"),
        ({"checkpoints": {"a/b": "run"}}, "spec.yaml: checkpoints.a/b.[key]: String should match pattern"),
    ],
)
def test_bad_specs_fail_with_one_line(tmp_path, capsys, changes, fragment):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**BASE, **changes}))
    code, err = sweep_cli(capsys, tmp_path / "spec.yaml")
    assert code == 2 and err.count("\n") == 1 and fragment in err, err


def test_missing_and_malformed_spec_files(tmp_path, capsys):
    code, err = sweep_cli(capsys, tmp_path / "none.yaml")
    assert code == 2 and err.count("\n") == 1 and "none.yaml does not exist" in err
    (tmp_path / "bad.yaml").write_text("task: [unclosed\n")
    code, err = sweep_cli(capsys, tmp_path / "bad.yaml")
    assert code == 2 and err.count("\n") == 1 and "bad.yaml:2: not valid YAML" in err, err


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_tensor_parallel_sweep_equals_tp1(sweep, tmp_path):
    """Every point loads the megatron model again in the same processes (TP=2 over 2 processes)."""
    tmp, rows = sweep
    setdiff("eval", "sweep", tmp / "spec.yaml", "--out", tmp_path, "--nproc", "2", "--tp", "2", "--no-progress")
    for row in rows:
        point = Path(row["dir"]).relative_to(tmp / "out")
        assert scored(tmp_path / point) == scored(tmp / "out" / point)


def scored(path: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("seconds", "busy_seconds")}
        for line in (path / "scored.jsonl").read_text().splitlines()
    ]


def test_wandb_logging_is_offline_by_default(monkeypatch, tmp_path):
    """The calls a job makes, against a stand-in wandb module (the package is an optional extra)."""
    calls = []

    class Run:
        summary = {}

        def log(self, data, step=None):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    stub = types.ModuleType("wandb")
    stub.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    stub.Table = lambda columns, data: ("table", columns, data)
    monkeypatch.setitem(sys.modules, "wandb", stub)
    rows = [{"point": "ar", "score": 0.5, "tokens_per_s": 10.0}, {"point": "w4", "score": 0.4, "tokens_per_s": 20.0}]
    log_to_wandb(
        WandbConfig("proj"),
        job_type="eval-sweep",
        config={"a": 1},
        summary={"num_points": 2},
        rows=rows,
        out_dir=tmp_path,
    )
    assert calls[0] == (
        "init",
        {
            "project": "proj",
            "name": None,
            "mode": "offline",
            "job_type": "eval-sweep",
            "config": {"a": 1},
            "dir": str(tmp_path),
            "reinit": True,
        },
    )
    assert calls[1] == ("log", {"score": 0.5, "tokens_per_s": 10.0}, 0)
    table = ("table", ["point", "score", "tokens_per_s"], [["ar", 0.5, 10.0], ["w4", 0.4, 20.0]])
    assert calls[3][1]["points"] == table
    assert Run.summary == {"num_points": 2} and calls[-1] == ("finish",)
    log_to_wandb(WandbConfig(None), job_type="x", config={}, summary={})  # no project: nothing happens
    assert len(calls) == 5
