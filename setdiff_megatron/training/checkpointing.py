"""Checkpoints of the megatron engine: sharded, atomic, verified, resumable on another layout.

Layout under `<checkpoint.dir>/checkpoints/`:

    step_00000300/           a published checkpoint
      (dist_checkpointing)   model and optimizer shards + metadata, loadable at any TP/PP/DP
      rank_00000.pt ...      per-rank RNG states (python, numpy, torch, CUDA, megatron tracker)
      train_state.json       step, consumed samples, LR scheduler, skipped steps
      recipe.yaml            the resolved recipe;   tokenizer/  the tokenizer files
      manifest.json          size of every file above, written last
    latest                   the name of the newest published checkpoint, updated last

A checkpoint is written to `step_N.tmp`, verified against its manifest by rank 0, renamed into
place (atomic on one filesystem) and only then named in `latest`; a crash at any point leaves
the previous checkpoint valid and `latest` pointing at it. Retention never removes the newest
valid checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import Recipe, save_resolved_recipe

__all__ = ["TrainState", "save", "maybe_resume", "find_checkpoints", "is_valid", "CHECKPOINTS"]

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
# The distributed optimizer's state is only saveable on the CPU path in this sharding (MEGATRON_CPU.md).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def _root(recipe: Recipe) -> Path:
    return Path(recipe.checkpoint.dir) / CHECKPOINTS


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _sharded_state(chunks, optimizer, *, is_loading: bool) -> dict:
    model = {f"model{i}": c.module.sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    # The optimizer's shards are keyed by the model's sharded tensors, found by parameter.
    optim = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return {**model, "optimizer": optim}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(), "torch": torch.get_rng_state(),
        # numpy's key array as a tensor, so the file loads with weights_only=True
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _write_manifest(directory: Path) -> None:
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def is_valid(directory: Path) -> tuple[bool, str]:
    """Whether every file of the manifest is present with its recorded size."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False, "no manifest (an interrupted save?)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False, "unreadable manifest"
    for rel, size in files.items():
        path = directory / rel
        if not path.is_file():
            return False, f"missing {rel}"
        if path.stat().st_size != size:
            return False, f"{rel} has {path.stat().st_size} bytes, manifest says {size}"
    return True, "ok"


def find_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints under `root`, newest first (valid or not)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)


def _apply_retention(recipe: Recipe, root: Path) -> None:
    keep_last, keep_every = recipe.checkpoint.keep_last_n, recipe.checkpoint.keep_every_n_steps
    if keep_last is None:
        return
    published = find_checkpoints(root)
    newest_valid = next((p for p in published if is_valid(p)[0]), None)
    for i, path in enumerate(published):
        step = int(path.name.split("_")[1])
        keep = i < keep_last or path == newest_valid or (keep_every and step % keep_every == 0)
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def save(recipe: Recipe, chunks, optimizer, scheduler, state: TrainState, tokenizer) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint directory."""
    from megatron.core import dist_checkpointing

    rank, root = dist.get_rank(), _root(recipe)
    final = root / _name(state.step)
    tmp = root / f"{final.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save of this step
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(chunks, optimizer, is_loading=False), str(tmp))
    torch.save(_rng_state(), tmp / f"rank_{rank:05d}.pt")
    if rank == 0:
        train_state = {**asdict(state), "scheduler": scheduler.state_dict()}
        (tmp / "train_state.json").write_text(json.dumps(train_state, indent=1))
        save_resolved_recipe(recipe, tmp)
        tokenizer.save(tmp / "tokenizer")
    dist.barrier()
    if rank == 0:
        _write_manifest(tmp)
        ok, why = is_valid(tmp)
        if not ok:
            raise RuntimeError(f"checkpoint {tmp} failed verification: {why}")
        if final.exists():  # a re-save of the same step (after a resume): replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        pointer = root / f"{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        pointer.replace(root / LATEST)
        _apply_retention(recipe, root)
    dist.barrier()
    return final


def _resume_target(recipe: Recipe) -> Path | None:
    """The checkpoint to resume from, reporting (on rank 0) invalid ones that were skipped."""
    choice = recipe.checkpoint.resume
    if choice == "none":
        return None
    if choice != "auto":
        path = Path(choice)
        ok, why = is_valid(path)
        if not ok:
            raise UserError(f"checkpoint.resume: {path} is not a valid checkpoint ({why})")
        return path
    for path in find_checkpoints(_root(recipe)):
        ok, why = is_valid(path)
        if ok:
            return path
        if dist.get_rank() == 0:
            print(f"setdiff: skipping invalid checkpoint {path}: {why}")
    return None


def _fill_optimizer_state(optimizer) -> None:
    """Give every parameter an Adam state (step, moments) before a sharded load: the load fills
    existing tensors in place, and megatron's own init leaves `step` out (MEGATRON_CPU.md)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if "exp_avg" in st or not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                    continue
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p.data)
                st["exp_avg_sq"] = torch.zeros_like(p.data)


def _restore_adam_steps(optimizer) -> None:
    """Set each parameter's Adam `step` from its loaded param group. Without Apex/TE, megatron's
    distributed optimizer keeps the step in the param groups but leaves the per-parameter state
    at its pre-load value, and torch's Adam reads (and increments in place) the per-parameter one;
    each parameter gets its own tensor so one increment is one step (MEGATRON_CPU.md)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def maybe_resume(recipe: Recipe, chunks, optimizer, scheduler, state: TrainState) -> Path | None:
    """Load the checkpoint that `checkpoint.resume` selects into the freshly built objects."""
    from megatron.core import dist_checkpointing

    path = _resume_target(recipe)
    if path is None:
        return None
    _fill_optimizer_state(optimizer)
    with torch.no_grad():
        loaded = dist_checkpointing.load(_sharded_state(chunks, optimizer, is_loading=True), str(path))
        for i, c in enumerate(chunks):
            c.module.load_state_dict(loaded[f"model{i}"])
        optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    train_state = json.loads((path / "train_state.json").read_text())
    scheduler.load_state_dict(train_state.pop("scheduler"))
    for key, value in train_state.items():
        setattr(state, key, value)
    rng_file = path / f"rank_{dist.get_rank():05d}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than saved: fresh seeds then
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return path
