"""Write converted weights as a checkpoint of the megatron engine, at a chosen TP x PP layout.

Layout, as the training engines publish it (checkpoint/): <run>/checkpoints/step_00000000/ with
megatron dist_checkpointing shards, train_state.json (step 0, the parallel layout, the model
config, the tokenizer's vocabulary and MASK id), recipe.yaml, tokenizer/ and a sha256
manifest, and <run>/checkpoints/latest. It holds weights only: no optimizer state, so the layout
records `distributed_optimizer: null` (a resume then loads the weights and starts the optimizer
fresh, as after switching optimizers) and train_state.json says `weights_only: true`.

How: tp * pp gloo processes (CPU only, CUDA hidden), each building its megatron model chunk
(models/megatron_model.py, local backend), loading its share mapped by
weight_maps.torch_to_megatron, and saving through dist_checkpointing like the engine does. Each
process reads the source itself (safetensors are memory-mapped), so nothing large is pickled
between processes. With pp == 1 the processes also run the megatron model on the verification
batch, so the comparison covers the megatron body and its weight map, not only the files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from setdiff_megatron.checkpoint.identity import model_identity
from setdiff_megatron.checkpoint.manifest import write_manifest
from setdiff_megatron.checkpoint.names import CHECKPOINTS, LATEST, TOKENIZER_DIR, step_name
from setdiff_megatron.checkpoint.state import Progress, TrainState, write_train_state
from setdiff_megatron.distributed.runtime import free_port
from setdiff_megatron.errors import UserError

__all__ = ["write_megatron_checkpoint", "STEP_DIR", "VERIFY_FILE"]

STEP_DIR = step_name(0)
VERIFY_FILE = "megatron_query_logits.safetensors"
_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def import_recipe(source, run_dir: Path, *, tp: int, pp: int, dtype: torch.dtype):
    """The recipe recorded with an imported checkpoint: its model, its tokenizer, this layout."""
    from setdiff_megatron.recipes.schema import (CheckpointSection, DataSection, ModelSection, ParallelSection,
                                                 Recipe, TrainSection)

    step_dir = run_dir / "checkpoints" / STEP_DIR
    return Recipe(
        name=f"import-{source.path.name}",
        description=f"{source.describe()}, imported by setdiff convert from-hf",
        model=ModelSection(**asdict(source.config)),
        data=DataSection(tokenizer=str(step_dir / "tokenizer"), seq_len=min(source.config.max_seq_len, 1024)),
        # megatron-core trains MoE layers under TP only with sequence parallelism.
        parallel=ParallelSection(tp=tp, pp=pp, sequence_parallel=tp > 1 and bool(source.config.num_experts)),
        train=TrainSection(precision=_PRECISION[dtype]),
        checkpoint=CheckpointSection(dir=str(run_dir)),
    )


def write_megatron_checkpoint(source_path: Path, stage: Path, final: Path, *, tp: int, pp: int,
                              dtype: torch.dtype, verify_dir: Path | None) -> Path:
    """Run the tp * pp writer processes into `stage` (a run directory that will be renamed to
    `final`); returns the step directory. `verify_dir` receives the megatron logits (pp == 1)."""
    spec = {"source": str(source_path), "stage": str(stage), "final": str(final), "tp": tp, "pp": pp,
            "dtype": _PRECISION[dtype], "verify_dir": str(verify_dir) if verify_dir and pp == 1 else None}
    spec_file = stage / "import_spec.json"
    spec_file.write_text(json.dumps(spec))
    world, port = tp * pp, free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-m", "setdiff_megatron.hf.megatron_writer", str(spec_file)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate()[0] for p in procs]
    spec_file.unlink()
    failed = [(r, out) for r, (p, out) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    if failed:
        rank, out = failed[0]
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        user = [ln for ln in lines if ln.startswith("setdiff: error: ")]
        if user:
            raise UserError(user[-1].removeprefix("setdiff: error: "))
        raise RuntimeError(f"megatron writer rank {rank} failed:\n" + "\n".join(lines[-30:]))
    step_dir = stage / CHECKPOINTS / STEP_DIR
    write_manifest(step_dir, collective=False)
    (stage / CHECKPOINTS / LATEST).write_text(STEP_DIR + "\n")
    return step_dir


# ---- the writer process ---------------------------------------------------------------------

def _train_state(recipe, tokenizer, *, tp: int, pp: int, source) -> TrainState:
    from setdiff_megatron.distributed.layout import Layout

    cfg = recipe.model.to_model_config(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id)
    t = recipe.train
    # What megatron's OptimizerParamScheduler.load_state_dict reads; a resume overrides the values.
    scheduler = {"max_lr": t.lr, "min_lr": t.min_lr, "lr_warmup_steps": t.warmup_steps, "num_steps": 0,
                 "lr_decay_style": t.schedule, "lr_decay_steps": t.steps or 1, "start_wd": t.weight_decay,
                 "end_wd": t.weight_decay, "wd_incr_style": "constant", "wd_incr_steps": t.steps or 1}
    return TrainState(
        progress=Progress(), scheduler=scheduler,
        layout={**Layout(tp=tp, pp=pp).as_record(), "distributed_optimizer": None},
        model=model_identity(cfg), tokenizer={"vocab_size": tokenizer.vocab_size, "mask_id": tokenizer.mask_id},
        weights_only=True, source={"format": source.kind, "path": str(source.path)})


def main(spec_file: str) -> int:
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(spec_file).read_text())
    import torch.distributed as dist

    from setdiff_megatron.checkpoint.megatron import model_sharded_state, save_shards
    from setdiff_megatron.checkpoint.source import read_source
    from setdiff_megatron.distributed.layout import Layout
    from setdiff_megatron.distributed.runtime import init_model_parallel, model_parallel_ranks, shutdown
    from setdiff_megatron.hf import verify
    from setdiff_megatron.models.megatron_model import build_model_chunks, transformer_config_from
    from setdiff_megatron.models.weight_maps import torch_to_megatron
    from setdiff_megatron.recipes import save_resolved_recipe

    tp, pp = spec["tp"], spec["pp"]
    dtype = {v: k for k, v in _PRECISION.items()}[spec["dtype"]]
    init_model_parallel(Layout(tp=tp, pp=pp), seed=0)
    try:
        rank = dist.get_rank()
        source = read_source(spec["source"])
        cfg = source.config
        recipe = import_recipe(source, Path(spec["final"]), tp=tp, pp=pp, dtype=dtype)
        config = transformer_config_from(cfg, tp=tp, pp=pp, params_dtype=dtype)
        (chunk,) = build_model_chunks(cfg, config, backend="local")
        tp_rank, pp_rank = model_parallel_ranks()
        state = torch_to_megatron({k: v.to(dtype) for k, v in source.state_dict.items()}, cfg,
                                  tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp)
        missing, unexpected = chunk.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"megatron chunk weights: missing {missing}, unexpected {unexpected}")
        step_dir = Path(spec["stage"]) / CHECKPOINTS / STEP_DIR
        if rank == 0:
            step_dir.mkdir(parents=True)
        dist.barrier()
        save_shards(model_sharded_state([chunk]), step_dir)
        if rank == 0:
            write_train_state(step_dir, _train_state(recipe, source.tokenizer, tp=tp, pp=pp, source=source))
            save_resolved_recipe(recipe, step_dir)
            source.tokenizer.save(step_dir / TOKENIZER_DIR)
        if spec["verify_dir"]:
            batch = verify.fixed_batch(cfg)
            with torch.no_grad():
                chunk.eval()
                logits = chunk.float()(batch.clean_tokens, batch.query_tokens, batch.position_ids)
            if rank == 0:
                from safetensors.torch import save_file

                save_file({"logits": logits.float().contiguous()}, str(Path(spec["verify_dir"]) / VERIFY_FILE))
        dist.barrier()
    except UserError as exc:
        print(f"setdiff: error: {exc}", flush=True)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
