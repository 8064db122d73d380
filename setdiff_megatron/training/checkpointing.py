"""Checkpoints of the megatron engine: sharded, atomic, verified, resumable on another layout.

Layout under `<checkpoint.dir>/checkpoints/`:

    step_00000300/           a published checkpoint
      (dist_checkpointing)   model and optimizer shards + metadata, loadable at any TP/PP/DP
      rank_00000.pt ...      per-rank RNG states (python, numpy, torch, CUDA, megatron tracker)
      train_state.json       step, consumed samples, LR scheduler, parallel layout, the resolved
                             model config, the tokenizer's vocabulary size and MASK id
      recipe.yaml            the resolved recipe;   tokenizer/  the tokenizer files
      manifest.json          size and sha256 of every file above, written last
    latest                   the name of the newest published checkpoint, updated last

A checkpoint is written to `step_N.tmp` (preemption signals blocked, see signals.py), hashed by
all ranks (a share each), renamed into place by rank 0 (atomic on one filesystem) and only then
named in `latest`; a crash at any point leaves the previous checkpoint valid. Retention never
removes the checkpoint just published.

Resuming checks sizes and checksums and compares the saved model config with this run's:
`resume: auto` skips (and reports) broken or foreign checkpoints and takes the newest good one,
but refuses to start over when every checkpoint holds another model. The distributed optimizer
is saved in megatron's `fully_reshardable` format, so model and optimizer state both reshard
over TP, PP and DP; only switching `parallel.distributed_optimizer` itself restarts the Adam
moments (with a warning). RNG states are restored on an unchanged layout only.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import socket
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import yaml

from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes import Recipe, save_resolved_recipe
from setdiff_megatron.recipes.loading import RESOLVED_NAME
from setdiff_megatron.training import signals

__all__ = ["TrainState", "save", "maybe_resume", "preflight", "verify", "find_checkpoints", "describe",
           "CHECKPOINTS", "save_with", "write_run_files", "host_rng_state", "set_host_rng_state"]

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
PUBLISHED = re.compile(r"step_\d{8}")
# The canonical per-parameter format: reshardable over TP/PP/DP. Loading it on the torch-AdamW
# path needs `_load_optimizer` (MEGATRON_CPU.md: a plain load fails with KeyError 'step').
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
# Fields that change how a model computes or starts, not what it has learnt.
NOT_MODEL_IDENTITY = ("attention_impl", "init_std")
# Saved bytes per parameter, with margin: weights, fp32 main copy, two Adam moments.
CHECKPOINT_BYTES_PER_PARAM = 16


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def _root(recipe: Recipe) -> Path:
    return Path(recipe.checkpoint.dir) / CHECKPOINTS


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _report(text: str) -> None:
    if _rank_world()[0] == 0:
        print(f"setdiff: {text}", flush=True)


def layout(recipe: Recipe) -> dict:
    """The parallel layout of this run, as recorded in a checkpoint."""
    p, world = recipe.parallel, _rank_world()[1]
    return {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": world // (p.tp * p.pp), "world_size": world,
            "distributed_optimizer": p.distributed_optimizer}


def _layout_text(lay: dict) -> str:
    optim = "distributed optimizer" if lay["distributed_optimizer"] else "optimizer per rank"
    return f"tp {lay['tp']} pp {lay['pp']} vpp {lay['vpp'] or 1} dp {lay['dp']}, {optim}"


def _model_identity(recipe: Recipe, tokenizer) -> dict:
    config = recipe.model.to_model_config(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id)
    return {k: v for k, v in asdict(config).items() if k not in NOT_MODEL_IDENTITY}


# ---- files: manifest, verification, selection ------------------------------------------------

def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _share(items: list) -> list:
    """This rank's part of a list that every rank holds in the same order."""
    rank, world = _rank_world()
    return items[rank::world]


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _write_manifest(directory: Path) -> None:
    """Collective: each rank hashes a share of the files; rank 0 writes the manifest."""
    names = [sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                    if p.is_file() and p.name != MANIFEST)]
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)  # rank 0's listing is the truth for everyone
    mine = {rel: {"size": (directory / rel).stat().st_size, "sha256": _sha256(directory / rel)}
            for rel in _share(names[0])}
    parts = _gather(mine)
    if _rank_world()[0] == 0:
        files = dict(sorted(kv for part in parts for kv in part.items()))
        (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _file_problem(directory: Path, rel: str, entry: dict, checksums: bool) -> str | None:
    path = directory / rel
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != entry["size"]:
        return f"{path} has {path.stat().st_size} bytes, the manifest says {entry['size']} (truncated?)"
    if checksums and _sha256(path) != entry["sha256"]:
        return f"{path} does not match its sha256 in the manifest (corrupted or modified)"
    return None


def verify(directory: Path, *, checksums: bool = True, collective: bool = True) -> str | None:
    """Why `directory` is not a complete checkpoint (naming the file), or None if it is. With
    `collective` and torch.distributed initialised, every rank calls it and reads a share."""
    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        entries = sorted(json.loads((directory / MANIFEST).read_text())["files"].items())
        if not all(isinstance(e, dict) and {"size", "sha256"} <= e.keys() for _, e in entries):
            raise ValueError
    except FileNotFoundError:
        return f"{directory / MANIFEST} is missing (an interrupted save?)"
    except (ValueError, KeyError, AttributeError):
        return f"{directory / MANIFEST} is unreadable"
    indexed = list(enumerate(entries))
    mine = _share(indexed) if collective else indexed
    found = [(i, p) for i, (rel, entry) in mine if (p := _file_problem(directory, rel, entry, checksums))]
    problems = sorted(x for part in (_gather(found) if collective else [found]) for x in part)
    return problems[0][1] if problems else None


def find_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints under `root`, newest first (valid or not)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and PUBLISHED.fullmatch(p.name)), reverse=True)


def _model_difference(directory: Path, model: dict | None) -> str | None:
    """How the checkpoint's model differs from this run's, naming the file, or None. `model` is
    None when the recipe allows a model change (checkpoint.allow_model_change): weights that
    no longer fit still fail to load, with dist_checkpointing's error."""
    if model is None:
        return None
    path = directory / TRAIN_STATE
    saved = json.loads(path.read_text()).get("model")
    if saved is None:
        return f"{path} records no model config (saved by an older setdiff)"
    # A field added to ModelConfig after the checkpoint was saved holds its default there.
    saved = {f.name: f.default for f in fields(ModelConfig) if f.name in model} | saved
    diffs = [f"{k} {saved.get(k)} there, {v} here" for k, v in model.items() if saved.get(k) != v]
    return f"{path} is for another model: {'; '.join(diffs)}" if diffs else None


def _resume_target(recipe: Recipe, model: dict) -> Path | None:
    """The checkpoint to resume from; `auto` reports (on rank 0) the ones it skips."""
    choice = recipe.checkpoint.resume
    model = None if recipe.checkpoint.allow_model_change else model
    if choice == "none":
        return None
    if choice != "auto":
        path = Path(choice)
        problem = verify(path) or _model_difference(path, model)
        if problem:
            raise UserError(f"checkpoint.resume: cannot load {path}: {problem}")
        return path
    foreign = None
    for path in find_checkpoints(_root(recipe)):
        problem = verify(path)
        if problem is None:
            foreign = _model_difference(path, model)
            if foreign is None:
                return path
            problem = foreign
        _report(f"skipping checkpoint {path}: {problem}")
    if foreign:
        raise UserError(f"checkpoint.dir {recipe.checkpoint.dir} holds checkpoints of another model "
                        f"({foreign}); refusing to train over them: use a new checkpoint.dir "
                        "(or checkpoint.allow_model_change=true to load them anyway)")
    return None


# ---- saving -----------------------------------------------------------------------------------

def preflight(recipe: Recipe) -> None:
    """Fail in seconds, not after hours of training: the checkpoint directory must take a file,
    and its disk must have room for one more checkpoint of this model (an estimate)."""
    directory = Path(recipe.checkpoint.dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        raise UserError(f"checkpoint.dir {directory} is not writable: {exc.strerror or exc}") from None
    vocab = recipe.data.vocab_size
    if recipe.data.tokenizer is not None:
        from setdiff_megatron.data.tokenizers import load_tokenizer

        vocab = load_tokenizer(recipe.data.tokenizer).vocab_size
    need = recipe.model.to_model_config(vocab_size=vocab, mask_token_id=0).num_params() * CHECKPOINT_BYTES_PER_PARAM
    free = shutil.disk_usage(directory).free
    if free < need:
        raise UserError(f"checkpoint.dir {directory} has {free / 2**30:.2f} GiB free; a checkpoint of this "
                        f"model needs about {need / 2**30:.2f} GiB")


def _sharded_state(chunks, optimizer, *, is_loading: bool) -> dict:
    """Model chunks (and the optimizer, unless None) as one dist_checkpointing state dict."""
    model = {f"model{i}": c.module.sharded_state_dict(prefix="") for i, c in enumerate(chunks)}
    if optimizer is None:
        return model
    # The optimizer's shards are keyed by the model's sharded tensors, found by parameter.
    optim = optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return {**model, "optimizer": optim}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {**host_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    set_host_rng_state(state)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _publish(tmp: Path, final: Path, root: Path) -> None:
    """Rank 0: rename a written checkpoint into place, then point `latest` at it."""
    problem = verify(tmp, checksums=False, collective=False)  # the files other ranks wrote, as seen here
    if problem:
        raise RuntimeError(f"checkpoint {tmp} failed verification: {problem}")
    if final.exists():  # a re-save of the same step (after a resume): swap it whole
        aside = final.with_name(f"{final.name}.old")
        final.rename(aside)
        tmp.rename(final)
        shutil.rmtree(aside)
    else:
        tmp.rename(final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    pointer.replace(root / LATEST)


def _apply_retention(recipe: Recipe, root: Path, keep: Path) -> None:
    keep_last, keep_every = recipe.checkpoint.keep_last_n, recipe.checkpoint.keep_every_n_steps
    if keep_last is None:
        return
    for i, path in enumerate(find_checkpoints(root)):
        step = int(path.name.split("_")[1])
        if not (i < keep_last or path == keep or (keep_every and step % keep_every == 0)):
            shutil.rmtree(path, ignore_errors=True)


def save(recipe: Recipe, chunks, optimizer, scheduler, state: TrainState, tokenizer) -> Path:
    """Collective: every rank calls it. Returns the published checkpoint directory."""
    from megatron.core import dist_checkpointing

    def write(tmp: Path) -> None:
        dist_checkpointing.save(_sharded_state(chunks, optimizer, is_loading=False), str(tmp))
        torch.save(_rng_state(), tmp / f"rank_{dist.get_rank():05d}.pt")
        if dist.get_rank() == 0:
            write_run_files(tmp, recipe, state, scheduler, tokenizer, layout(recipe))

    return save_with(recipe, state.step, write)


# ---- loading ----------------------------------------------------------------------------------

def _adam_optimizers(optimizer) -> list:
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o.optimizer, torch.optim.Adam | torch.optim.AdamW)]


def _fill_optimizer_state(optimizer) -> None:
    """Give every parameter an Adam state (step, moments) before a sharded load: the load fills
    existing tensors in place, and megatron's own init leaves `step` out (MEGATRON_CPU.md)."""
    for opt in _adam_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)


def _restore_adam_steps(optimizer) -> None:
    """Set each parameter's Adam `step` from its loaded param group. Without Apex/TE, megatron's
    distributed optimizer keeps the step in the param groups but leaves the per-parameter state
    at its pre-load value, and torch's Adam reads (and increments in place) the per-parameter one;
    each parameter gets its own tensor so one increment is one step (MEGATRON_CPU.md)."""
    for opt in _adam_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "exp_avg" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _load_optimizer(optimizer, loaded: dict) -> None:
    """Load optimizer state. A distributed optimizer's per-parameter part is loaded apart:
    megatron's fully-reshardable loader copies every key of the live per-parameter state, `step`
    included, which the checkpoint keeps in the param groups instead (KeyError 'step')."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [loaded] if len(optimizers) == 1 else [loaded[k] for k in sorted(loaded)]
    param_states = []
    for opt, part in zip(optimizers, parts):
        if isinstance(opt, DistributedOptimizer):
            param_states.append((opt, part.pop("param_state")))
            part.pop("param_state_sharding_type")
    optimizer.load_state_dict(loaded)  # param groups (with the step), grad scaler, plain states
    for opt, param_state in param_states:
        for st in opt.optimizer.state.values():
            st.pop("step", None)
        opt.load_parameter_state_from_fully_reshardable(param_state)
    _restore_adam_steps(optimizer)


def maybe_resume(recipe: Recipe, chunks, optimizer, scheduler, state: TrainState, tokenizer) -> Path | None:
    """Load the checkpoint that `checkpoint.resume` selects into the freshly built objects."""
    from megatron.core import dist_checkpointing

    path = _resume_target(recipe, _model_identity(recipe, tokenizer))
    if path is None:
        return None
    saved = json.loads((path / TRAIN_STATE).read_text())
    here = layout(recipe)
    with_optimizer = saved["layout"]["distributed_optimizer"] == here["distributed_optimizer"]
    if saved["layout"] != here:
        _report(f"loading {path}, saved at {_layout_text(saved['layout'])}, into {_layout_text(here)}")
    if not with_optimizer:
        _report("warning: parallel.distributed_optimizer changed since the checkpoint: Adam moments start "
                "from zero; weights, step, LR schedule and data position are restored")
    else:
        _fill_optimizer_state(optimizer)
    with torch.no_grad():
        loaded = dist_checkpointing.load(
            _sharded_state(chunks, optimizer if with_optimizer else None, is_loading=True), str(path))
        for i, c in enumerate(chunks):
            c.module.load_state_dict(loaded[f"model{i}"])
        if with_optimizer:
            _load_optimizer(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    for key in asdict(state):
        setattr(state, key, saved[key])
    if saved["layout"] == here:  # other layouts draw fresh streams from the recipe's seed
        _set_rng_state(torch.load(path / f"rank_{dist.get_rank():05d}.pt", weights_only=True))
    return path


# ---- inspection -------------------------------------------------------------------------------

def describe(run_dir: str | Path) -> list[str]:
    """One line per checkpoint of a run directory (or of its checkpoints/ folder), newest first:
    step, validity (why not), recipe, layout, tokenizer, and which one `latest` names."""
    root = Path(run_dir)
    root = root / CHECKPOINTS if (root / CHECKPOINTS).is_dir() else root
    published = find_checkpoints(root)
    partial = sorted(root.glob("step_*.tmp")) if root.is_dir() else []
    if not published and not partial:
        raise UserError(f"no checkpoints under {run_dir}")
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    lines = []
    for path in published:
        problem = verify(path)
        line = f"{path.name}  {'valid' if problem is None else 'INVALID: ' + problem}"
        try:
            saved = json.loads((path / TRAIN_STATE).read_text())
            name = yaml.safe_load((path / RESOLVED_NAME).read_text())["name"]
            tok = saved["tokenizer"]
            line += (f"  | step {saved['step']}, recipe {name}, {_layout_text(saved['layout'])}, "
                     f"tokenizer vocab {tok['vocab_size']} mask id {tok['mask_id']}")
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
            line += "  | (train_state.json or recipe.yaml unreadable)"
        lines.append(line + ("  <- latest" if path.name == latest else ""))
    lines += [f"{p.name}  partial save (ignored; removed by the next save)" for p in partial]
    if latest is None or latest not in {p.name for p in published}:
        lines.append(f"latest: {latest or 'absent'} (no published checkpoint of that name)")
    return lines


# ---- the publication protocol of every engine ------------------------------------------------
# `save` above (megatron) and deepspeed_checkpointing.py write their checkpoints through these.

def save_with(recipe: Recipe, step: int, write: Callable[[Path], None]) -> Path:
    """Collective: publish the checkpoint of `step` that `write(tmp)` writes on every rank, the
    way `save` does: preemption signals blocked, interrupted saves cleared, a manifest hashed by
    all ranks, an atomic rename and `latest` by rank 0, then retention. Returns the directory."""
    rank, root = _rank_world()[0], _root(recipe)
    final = root / _name(step)
    tmp = final.with_name(f"{final.name}.tmp")
    with signals.blocked():
        if rank == 0:
            for stale in [*root.glob("step_*.tmp"), *root.glob("step_*.old")]:
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        write(tmp)
        dist.barrier()
        _write_manifest(tmp)
        if rank == 0:
            _publish(tmp, final, root)
            _apply_retention(recipe, root, keep=final)
        dist.barrier()
    return final


def write_run_files(directory: Path, recipe: Recipe, state: TrainState, scheduler, tokenizer, run_layout: dict) -> None:
    """Rank 0: what a resume and `describe` read besides the weights, as `save` writes it:
    train_state.json (step, data position, scheduler, layout, model identity, tokenizer), the
    resolved recipe and the tokenizer files."""
    train_state = {**asdict(state), "scheduler": scheduler.state_dict(), "layout": run_layout,
                   "model": _model_identity(recipe, tokenizer),
                   "tokenizer": {"vocab_size": tokenizer.vocab_size, "mask_id": tokenizer.mask_id}}
    (directory / TRAIN_STATE).write_text(json.dumps(train_state, indent=1))
    save_resolved_recipe(recipe, directory)
    tokenizer.save(directory / "tokenizer")


def host_rng_state() -> dict:
    """Python, numpy, torch and CUDA generator states, loadable with weights_only=True."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_host_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
