"""Converted weights as step 0 of a megatron-engine run, published like a training checkpoint.

One megatron chunk at TP = PP = 1 (local backend) takes the weights in this process and saves them
through dist_checkpointing as the engine does, every tensor at its global shape, so the engine
resumes the checkpoint at any layout. Without a GPU that switches megatron's CPU mode on for the
rest of the process's life, so it is the work of a process of its own (`setdiff convert
from-hf`). The checkpoint holds weights only (`_train_state`). The chunk then runs the
verification batch, so the import's check covers the megatron body and its weight map too.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from setdiff_megatron.checkpoint.identity import model_identity
from setdiff_megatron.checkpoint.megatron_shards import model_sharded_state, save_shards
from setdiff_megatron.checkpoint.names import CHECKPOINTS, TOKENIZER_DIR, step_name
from setdiff_megatron.checkpoint.publish import publish
from setdiff_megatron.checkpoint.state import Progress, TrainState, write_train_state
from setdiff_megatron.distributed.layout import Layout
from setdiff_megatron.distributed.runtime import init_model_parallel, shutdown
from setdiff_megatron.hf import verify
from setdiff_megatron.models.dtypes import name_of
from setdiff_megatron.recipes import Recipe, save_resolved_recipe
from setdiff_megatron.sampling.decoding import SETTINGS
from setdiff_megatron.sources.read import Source

__all__ = ["write_megatron_checkpoint"]


def import_recipe(source: Source, run_dir: Path, dtype: torch.dtype) -> Recipe:
    """The recipe recorded with an imported checkpoint: its model, its tokenizer, its precision,
    its decoding policy, and where the source has them (a SetDLM release) its order law and
    sequence length."""
    from setdiff_megatron.recipes.decoding_settings import DecodingSection
    from setdiff_megatron.recipes.schema import (
        CheckpointSection,
        DataSection,
        MethodSection,
        ModelSection,
        TrainSection,
    )

    tokenizer = run_dir / CHECKPOINTS / step_name(0) / TOKENIZER_DIR
    seq_len = source.recipe.data.seq_len if source.recipe is not None else min(source.config.max_seq_len, 1024)
    return Recipe(
        name=f"import-{source.path.name}",
        description=f"{source.describe()}, imported by setdiff convert from-hf",
        model=ModelSection(**asdict(source.config)),
        method=source.recipe.method if source.recipe is not None else source.method or MethodSection(),
        data=DataSection(tokenizer=str(tokenizer), seq_len=seq_len),
        train=TrainSection(precision=name_of(dtype)),
        checkpoint=CheckpointSection(dir=str(run_dir)),
        decoding=DecodingSection(**{name: getattr(source.decoding, name) for name in SETTINGS}),
    )


def write_megatron_checkpoint(source: Source, stage: Path, final: Path, *, dtype: torch.dtype) -> torch.Tensor:
    """Publish `source` at `dtype` as step 0 of the run directory `stage` (renamed to `final`
    once checked, which is what the recipe records); returns the megatron chunk's query logits
    on the verification batch (float32, CPU)."""
    recipe = import_recipe(source, final, dtype)
    init_model_parallel(Layout(), seed=recipe.train.seed)
    try:
        chunk = _loaded_chunk(source, dtype)
        publish(stage / CHECKPOINTS, 0, lambda tmp: _write_step(tmp, chunk, source, recipe), run_id=None)
        return _megatron_query_logits(chunk, source)
    finally:
        shutdown()


def _loaded_chunk(source: Source, dtype: torch.dtype):
    """The whole model as one megatron chunk at `dtype`, holding the source's weights."""
    from setdiff_megatron.models.megatron_forward import build_model_chunks, transformer_config_from
    from setdiff_megatron.models.weight_maps.megatron_map import torch_to_megatron

    (chunk,) = build_model_chunks(source.config, transformer_config_from(source.config, params_dtype=dtype))
    state = torch_to_megatron({k: v.to(dtype) for k, v in source.state_dict.items()}, source.config)
    missing, unexpected = chunk.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"megatron chunk weights: missing {missing}, unexpected {unexpected}")
    return chunk


def _write_step(tmp: Path, chunk, source: Source, recipe: Recipe) -> None:
    """The files of the checkpoint, as the trainer's save writes them, into publish's `tmp`."""
    save_shards(model_sharded_state([chunk]), tmp)
    write_train_state(tmp, _train_state(source))
    save_resolved_recipe(recipe, tmp)
    source.tokenizer.save(tmp / TOKENIZER_DIR)


def _train_state(source: Source) -> TrainState:
    """Weights only: `weights_only: true` and a layout with `distributed_optimizer: null`, which
    the engine's load reads as no optimizer state (the Adam moments start fresh) and no scheduler
    state (the run's own schedule starts at step 0). No run wrote the checkpoint, so it records no
    run id."""
    tokenizer = source.tokenizer
    return TrainState(
        progress=Progress(),
        scheduler={},
        layout={**Layout().as_record(), "distributed_optimizer": None},
        model=model_identity(source.config),
        tokenizer={"vocab_size": tokenizer.vocab_size, "mask_id": tokenizer.mask_id},
        weights_only=True,
        source={"format": source.kind, "path": str(source.path)},
    )


def _megatron_query_logits(chunk, source: Source) -> torch.Tensor:
    """The chunk's query logits on the verification batch, run in float32 where it lives."""
    batch = verify.fixed_batch(source.config)
    device = next(chunk.parameters()).device
    inputs = (batch.clean_tokens.to(device), batch.query_tokens.to(device), batch.position_ids.to(device))
    with torch.no_grad():
        return chunk.float().eval()(*inputs).float().cpu()
