"""Which checkpoint a job uses: the one a training run resumes from, or the one a reader reads.

`resume_target` applies `checkpoint.resume` (auto, none or a path; its docstring says how),
`resolve_step_dir` finds the step directory a reader names (`latest` first, then the newest
valid one), and `describe` writes the lines of `setdiff checkpoint inspect`. Nothing here deletes
a checkpoint: `none` moves the old ones aside (docs/training.md, "Training and checkpoints").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from setdiff_megatron.checkpoint.identity import identity_difference
from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.checkpoint.names import CHECKPOINTS, LATEST, TRAIN_STATE, checkpoints_root, find_checkpoints
from setdiff_megatron.checkpoint.publish import move_aside
from setdiff_megatron.checkpoint.state import TrainState, read_train_state
from setdiff_megatron.distributed.runtime import barrier, rank
from setdiff_megatron.errors import UserError
from setdiff_megatron.log import say
from setdiff_megatron.recipes.recipe_files import RESOLVED_NAME

__all__ = ["Resumed", "resume_target", "resolve_step_dir", "describe"]


@dataclass(frozen=True)
class Resumed:
    path: Path
    state: TrainState


def usable_problem(directory: Path, identity: dict | None, *, collective: bool = False) -> str | None:
    """Why a checkpoint cannot be resumed by a run of model `identity` (None: any model), or None."""
    problem = verify(directory, collective=collective)
    if problem:
        return problem
    try:
        state = read_train_state(directory)
    except UserError as exc:
        return str(exc)
    if identity is not None and (diff := identity_difference(state.model, identity)):
        return f"{directory / TRAIN_STATE} is for another model: {diff}"
    return None


def resume_target(run_dir: Path, choice: str, identity: dict | None) -> Resumed | None:
    """Collective: the checkpoint `choice` (`checkpoint.resume`) selects for a run of model
    `identity` (None when the recipe allows a model change).

    auto   the newest checkpoint that is complete (manifest), readable (train_state.json) and of
           this model; every one skipped is reported on the console with the reason. When the run
           directory holds checkpoints but none of them can be resumed, training stops with one
           line per checkpoint saying why (exit code 2): an hour of training is not silently
           started over beside them, and a repaired file can still save them.
    none   start over; the checkpoints already there are moved aside first (`*.aside-<time>`,
           never deleted), so a later `auto` does not mistake them for this run's.
    PATH   exactly that checkpoint, or an error saying why it cannot be used.
    """
    root = Path(run_dir) / CHECKPOINTS
    if choice == "none":
        if rank() == 0:
            for path in find_checkpoints(root):
                move_aside(path, "aside")
        barrier()
        return None
    if choice != "auto":
        path = Path(choice)
        problem = usable_problem(path, identity, collective=True)
        if problem:
            raise UserError(f"checkpoint.resume: cannot load {path}: {problem}")
        return Resumed(path, read_train_state(path))
    skipped = []
    for path in find_checkpoints(root):
        problem = usable_problem(path, identity, collective=True)
        if problem is None:
            return Resumed(path, read_train_state(path))
        say(f"setdiff: skipping checkpoint {path}: {problem}")
        skipped.append(f"{path.name}: {problem}")
    if skipped:
        model_hint = (
            " (or checkpoint.allow_model_change=true for another model's)"
            if any("another model" in s for s in skipped)
            else ""
        )
        raise UserError(
            f"checkpoint.dir {run_dir} holds checkpoints, and none can be resumed ({'; '.join(skipped)}); refusing "
            f"to train over them: repair them, point checkpoint.dir elsewhere, or set checkpoint.resume=none to start "
            f"over (they are then moved aside, not deleted){model_hint}"
        )
    return None


def resolve_step_dir(path: str | Path) -> Path:
    """The step directory `path` names: itself, or the newest valid one of a run (`latest` first)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if (path / TRAIN_STATE).is_file():
        problem = verify(path)
        if problem:
            raise UserError(f"checkpoint {path} is not usable: {problem}")
        return path
    root = checkpoints_root(path)
    candidates = find_checkpoints(root)
    if (root / LATEST).is_file():
        named = root / (root / LATEST).read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    for candidate in candidates:
        if verify(candidate) is None:
            return candidate
    if candidates:
        raise UserError(f"no valid checkpoint under {root}: {verify(candidates[0])}")
    raise UserError(
        f"{path} holds no checkpoint (no {TRAIN_STATE}, no {CHECKPOINTS}/{LATEST}); "
        "pass a run directory (checkpoint.dir) or one of its step_* directories"
    )


def _layout_text(lay: dict) -> str:
    optim = {True: "distributed optimizer", False: "optimizer per rank", None: "weights only"}
    return (
        f"tp {lay.get('tp')} pp {lay.get('pp')} vpp {lay.get('vpp') or 1} dp {lay.get('dp')}, "
        f"{optim.get(lay.get('distributed_optimizer'), '?')}"
    )


def describe(run_dir: str | Path) -> list[str]:
    """One line per checkpoint of a run directory (or of its checkpoints/ folder), newest first:
    step, validity (why not), recipe, layout, tokenizer, the average of the weights it holds, and
    which one `latest` names."""
    root = checkpoints_root(run_dir)
    published = find_checkpoints(root)
    partial = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    aside = sorted(p for p in root.glob("step_*.*-*") if p.is_dir()) if root.is_dir() else []
    if not published and not partial and not aside:
        raise UserError(f"no checkpoints under {run_dir}")
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    lines = []
    for path in published:
        problem = verify(path)
        line = f"{path.name}  {'valid' if problem is None else 'INVALID: ' + problem}"
        try:
            state = read_train_state(path)
            name = yaml.safe_load((path / RESOLVED_NAME).read_text())["name"]
            tok = state.tokenizer
            line += (
                f"  | step {state.progress.step}, recipe {name}, {_layout_text(state.layout)}, "
                f"tokenizer vocab {tok['vocab_size']} mask id {tok['mask_id']}"
            )
            if state.ema is not None:
                line += f", EMA of the weights (decay {state.ema['decay']}; read by sampling, evaluation and export)"
        except (UserError, OSError, KeyError, TypeError, yaml.YAMLError) as exc:
            line += f"  | {exc if isinstance(exc, UserError) else 'recipe.yaml unreadable'}"
        lines.append(line + ("  <- latest" if path.name == latest else ""))
    lines += [f"{p.name}  partial save (ignored; removed by the next save)" for p in partial]
    lines += [f"{p.name}  moved aside (kept; not resumed)" for p in aside]
    if latest is None or latest not in {p.name for p in published}:
        lines.append(f"latest: {latest or 'absent'} (no published checkpoint of that name)")
    return lines
