"""`setdiff eval sweep SPEC.yaml`: the speed-quality trade-off of decoding settings.

A spec names one generation task, one or more checkpoints, and the decoding settings to try:
explicit `points` and/or a `grid` (lists of values whose product is taken), over shared
`decoding` defaults; window 1 is autoregressive decoding, the baseline every set size is read
against. Every (checkpoint, point) is a `setdiff eval generate` job in OUT/points/CKPT/POINT,
so each is sharded over processes (--nproc, or --shard/--num-shards for SLURM arrays), resumed
and skipped once scored. When every point is scored, OUT/sweep.jsonl holds one row per point
(quality, tokens/s, tokens per step, NFE, batch size, hardware, settings), a table is printed,
and OUT/pareto.png plots quality against tokens/s and against tokens per step with the Pareto
frontier marked. See recipes/eval/sweep-tiny.yaml.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    StringConstraints,
    ValidationError,
)

from setdiff_megatron.errors import UserError
from setdiff_megatron.evaluation.records import WandbConfig, check_wandb, log_to_wandb, write_jsonl
from setdiff_megatron.evaluation.tasks import GenerateJob, read_tasks, run_generate_job
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.log import say
from setdiff_megatron.recipes.decoding_settings import settings_given, settings_model
from setdiff_megatron.sampling.decoding import SETTINGS

__all__ = ["load_spec", "pareto_front", "run_sweep", "add_parser"]

ROWS, PLOT = "sweep.jsonl", "pareto.png"
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.=+-]*$"
Name = Annotated[str, StringConstraints(pattern=_NAME)]
"""A point or checkpoint name, also a directory name."""


Settings = settings_model("Settings")
"""Decoding settings (sampling/decoding.py SETTINGS); a key left out keeps the checkpoint's own
policy, and null turns an optional setting off."""

Point = settings_model("Point", (), base=Settings, name=(Name | None, None))
"""A point's settings, and its directory and label (default: from its settings, e.g. w4-t0.9; ar
for window 1)."""


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str
    """A task file of `setdiff eval generate` (relative paths: from the working directory)."""
    metric: Literal["exact", "rouge", "gsm8k"]
    checkpoints: dict[Name, str] = Field(min_length=1)
    """name: checkpoint run directory, step_* directory or Hugging Face export."""
    out: str
    batch_size: PositiveInt = 16
    stop: list[str] = []
    add_bos: bool | None = None
    context_len: PositiveInt | None = None
    decoding: Settings = Settings()
    """Defaults of every point."""
    points: list[Point] = []
    grid: dict[str, list[Any]] = {}
    """setting: values; every combination is a point (after the explicit points). Every point
    decodes each checkpoint with its own policy where the point and `decoding` say nothing."""


@dataclass(frozen=True)
class SweepPoint:
    name: str
    decoding: dict[str, Any]
    """Settings over each checkpoint's own policy."""


def _format(exc: ValidationError, path: Path) -> str:
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "<top level>"
    if err["type"] == "extra_forbidden":
        owner = Point if err["loc"][0] == "points" else Settings if err["loc"][0] == "decoding" else SweepSpec
        msg = f"unknown key; allowed: {', '.join(owner.model_fields)}"
    else:
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
            msg += f" (got {err.get('input')!r})"
    return f"{path}: {key}: {msg}"


def load_spec(path: str | Path) -> SweepSpec:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sweep spec {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping with task, metric, checkpoints, out and points/grid")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as exc:
        raise UserError(_format(exc, path)) from None
    return spec


def _auto_name(given: dict[str, Any]) -> str:
    """A point's name from its settings' short names (sampling/decoding.py `Setting.short`): 'w4-t0.9';
    AR decoding's window of 1 reads 'ar'."""
    name = "-".join(SETTINGS[key].point_name(value) for key, value in given.items()) or "default"
    return "ar" + name[2:] if name == "w1" or name.startswith("w1-") else name


def expand_points(spec: SweepSpec, path: str | Path = "spec") -> list[SweepPoint]:
    """The explicit points, then the grid's product, each over the spec's decoding defaults."""
    given_points = [p.model_dump(exclude_unset=True) for p in spec.points]
    for key, values in spec.grid.items():
        if key not in Settings.model_fields:
            raise UserError(f"{path}: grid.{key}: unknown setting; allowed: {', '.join(Settings.model_fields)}")
        if not isinstance(values, list) or not values:
            raise UserError(f"{path}: grid.{key}: expected a non-empty list of values")
        for value in values:
            try:
                Settings.model_validate({key: value})
            except ValidationError as exc:
                raise UserError(_format(exc, Path(str(path)))) from None
    keys = list(spec.grid)
    given_points += [dict(zip(keys, combo)) for combo in itertools.product(*spec.grid.values())] if keys else []
    if not given_points:
        raise UserError(
            f"{path}: the sweep has no points: give 'points' (a list of decoding settings) and/or "
            "'grid' (a list of values per setting)"
        )
    defaults = settings_given(spec.decoding)
    points, seen = [], set()
    for settings in given_points:
        name = settings.pop("name", None) or _auto_name(settings)
        if name in seen:
            raise UserError(f"{path}: two points are named {name!r}; give them distinct 'name's")
        seen.add(name)
        points.append(SweepPoint(name, {**defaults, **settings}))
    return points


def pareto_front(xs: list[float], ys: list[float]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on each),
    sorted by x."""
    front = [
        i
        for i in range(len(xs))
        if not any(xs[j] >= xs[i] and ys[j] >= ys[i] and (xs[j] > xs[i] or ys[j] > ys[i]) for j in range(len(xs)))
    ]
    return sorted(front, key=lambda i: xs[i])


def plot_pareto(rows: list[dict], path: Path) -> None:
    """Quality against tokens/s and against tokens per step; frontier points joined and ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    score_name = rows[0]["score_name"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    checkpoints = list(dict.fromkeys(r["checkpoint"] for r in rows))
    for ax, (key, label) in zip(
        axes, (("tokens_per_s", "tokens/s (per replica)"), ("tokens_per_step", "tokens per step"))
    ):
        xs, ys = [r[key] or 0.0 for r in rows], [r["score"] for r in rows]
        for n, ckpt in enumerate(checkpoints):
            mine = [i for i, r in enumerate(rows) if r["checkpoint"] == ckpt]
            ax.scatter([xs[i] for i in mine], [ys[i] for i in mine], marker="os^Dv<>"[n % 7], label=ckpt, zorder=3)
        for i, r in enumerate(rows):
            ax.annotate(r["point"], (xs[i], ys[i]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        front = pareto_front(xs, ys)
        ax.plot(
            [xs[i] for i in front],
            [ys[i] for i in front],
            "k--",
            lw=1,
            drawstyle="steps-post",
            label="Pareto frontier",
            zorder=2,
        )
        ax.scatter([xs[i] for i in front], [ys[i] for i in front], s=140, facecolors="none", edgecolors="k", zorder=4)
        ax.set_xlabel(label)
        ax.set_ylabel(f"{score_name} (higher is better)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"speed-quality trade-off: {rows[0]['task']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def table(rows: list[dict]) -> str:
    header = ("checkpoint", "point", "W", "k", "tau", rows[0]["score_name"], "tok/s", "tok/step", "NFE")
    body = [
        (
            r["checkpoint"],
            r["point"],
            str(r["decoding"]["window"]),
            str(r["decoding"]["tokens_per_step"]),
            "-" if r["decoding"]["threshold"] is None else f"{r['decoding']['threshold']:g}",
            f"{r['score']:.4f}",
            "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_step']:.2f}",
            f"{r['mean_nfe']:.1f}",
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in (header, *body))


def _row(checkpoint: str, source: str, point: SweepPoint, metrics: dict, out: Path) -> dict[str, Any]:
    return {
        "checkpoint": checkpoint,
        "source": source,
        "point": point.name,
        "decoding": metrics["decoding"],
        "task": metrics["task"],
        "metric": metrics["metric"],
        "score_name": metrics["score_name"],
        "score": metrics["score"],
        "quality": metrics["quality"],
        "tokens_per_s": metrics["tokens_per_s"],
        "tokens_per_step": metrics["tokens_per_step"],
        "mean_nfe": metrics["mean_nfe"],
        "num_examples": metrics["num_examples"],
        "num_tokens": metrics["num_tokens"],
        "batch_size": metrics["batch_size"],
        "hardware": metrics["hardware"],
        "dir": str(out),
    }


def run_sweep(
    spec_path: str | Path,
    *,
    out: str | None = None,
    placement: Placement = Placement(),
    wandb: WandbConfig = WandbConfig(),
) -> list[dict] | None:
    """Run every point not yet scored; returns the rows on the process that merged (None elsewhere).
    The spec's batch size wins over the placement's: it is part of what a point measures."""
    spec = load_spec(spec_path)
    points = expand_points(spec, spec_path)
    read_tasks(spec.task)
    check_wandb(wandb)
    out_dir = Path(out or spec.out)
    main = int(os.environ.get("RANK", "0")) == 0
    rows, total = [], len(spec.checkpoints) * len(points)
    placement = replace(placement, batch_size=spec.batch_size)
    shard, num_shards = placement.shard, placement.num_shards
    for n, ((ckpt, source), point) in enumerate(itertools.product(spec.checkpoints.items(), points), start=1):
        point_dir = out_dir / "points" / ckpt / point.name
        say(f"setdiff: sweep point {n}/{total}: {ckpt} {point.name}", file=sys.stderr)
        metrics = run_generate_job(
            GenerateJob(
                source=source,
                tasks=spec.task,
                out=str(point_dir),
                metric=spec.metric,
                decoding=point.decoding,
                stop=tuple(spec.stop),
                placement=placement,
                add_bos=spec.add_bos,
                context_len=spec.context_len,
            )
        )
        if metrics is not None:
            rows.append(_row(ckpt, source, point, metrics, point_dir))
    if shard is not None or not main:
        if shard is not None:
            say(
                f"setdiff: sweep shard {shard} of {num_shards} done; rerun without --shard to merge and score",
                file=sys.stderr,
            )
        return None
    write_jsonl(out_dir / ROWS, rows)
    plot_pareto(rows, out_dir / PLOT)
    print(table(rows))
    say(f"setdiff: {len(rows)} points in {out_dir / ROWS}; plot {out_dir / PLOT}", file=sys.stderr)
    log_to_wandb(
        wandb,
        job_type="eval-sweep",
        out_dir=out_dir,
        rows=rows,
        config={"spec": json.loads(spec.model_dump_json()), "spec_path": str(spec_path)},
        summary={"num_points": len(rows)},
    )
    return rows


def _run(args) -> int:
    from setdiff_megatron.evaluation.tasks import wandb_from_args
    from setdiff_megatron.inference.cli_args import placement_from_args, relaunch

    spec = load_spec(args.spec)  # bad input fails once, before processes start
    points = expand_points(spec, args.spec)
    read_tasks(spec.task)
    if args.dry_run:
        for ckpt in spec.checkpoints:
            for p in points:
                print(f"{ckpt} {p.name}: its own policy with {json.dumps(p.decoding)}")
        return 0
    code = relaunch(args, out=args.out or spec.out)
    if code is not None:
        return code
    run_sweep(args.spec, out=args.out, placement=placement_from_args(args), wandb=wandb_from_args(args))
    return 0


def add_parser(jobs) -> None:
    from setdiff_megatron.evaluation.tasks import add_wandb_arguments
    from setdiff_megatron.inference.cli_args import add_job_arguments

    parser = jobs.add_parser(
        "sweep",
        help="speed-quality sweep over decoding settings (JSONL, table, Pareto plot)",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("spec", help="a sweep spec (YAML), e.g. recipes/eval/sweep-tiny.yaml")
    parser.add_argument("--out", default=None, help="output directory (default: the spec's out)")
    parser.add_argument("--dry-run", action="store_true", help="check the spec and print its points")
    add_job_arguments(parser, source=False, batch_size=False)  # the spec names the checkpoints and batch size
    add_wandb_arguments(parser)
    parser.set_defaults(func=_run)
