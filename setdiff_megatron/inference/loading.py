"""The model a sampling or evaluation job runs: from a megatron checkpoint or a Hugging Face
export, as the torch model (TP=1) or as the megatron model split over TP ranks.

At TP=1 every process holds the whole torch model: nothing of megatron is imported, and data
parallelism is just each process taking its own prompts. At TP > 1 the megatron model is built
on a model-parallel group and each rank loads only its own shard of a megatron checkpoint
through dist_checkpointing (an HF export is read whole and split by the weight map). Both bodies
implement the sampler's `StepModel`; the megatron one gathers its logits over TP, so every rank
of a TP group decides the same tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.core.sampler import StepModel
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import Recipe

__all__ = ["SamplingModel", "Ranks", "load_sampling_model", "init_ranks", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: its data-parallel shard and whether it writes (TP rank 0)."""

    rank: int = 0
    world_size: int = 1
    tp: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def writes(self) -> bool:
        return self.rank % self.tp == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


@dataclass
class SamplingModel:
    model: StepModel
    config: ModelConfig
    tokenizer: SetDiffTokenizer
    add_bos: bool
    """The training data started each sample with a clean BOS (recipe method.keep_clean_bos)."""
    source: Path
    recipe: Recipe | None
    """The recipe a checkpoint was trained with (None for a Hugging Face export)."""


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no GPU is visible to this process; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def init_ranks(tp: int) -> Ranks:
    """Join the process group torchrun (or srun) set up, if any, and split it into TP x DP."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1:
        raise UserError(f"--tp must be >= 1; got {tp}")
    if tp > world or world % tp:
        raise UserError(f"--tp {tp} needs a multiple of {tp} processes; this job has {world} "
                        f"(start it with --nproc {tp} or torchrun --nproc_per_node {tp})")
    if world == 1:
        return Ranks()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    # megatron orders ranks TP-fastest, so a TP group is `tp` consecutive ranks.
    return Ranks(rank=rank, world_size=world, tp=tp, dp_rank=rank // tp, dp_size=world // tp)


def _read_source(source: Path, *, weights: bool):
    """(config, torch weights or None, tokenizer, recipe or None, megatron step dir or None)."""
    from setdiff_megatron.training.checkpoint_reader import is_megatron_checkpoint, read_checkpoint

    if is_megatron_checkpoint(source):
        ckpt = read_checkpoint(source, weights=weights)
        return ckpt.config, ckpt.state_dict, ckpt.tokenizer, ckpt.recipe, ckpt.path
    if (source / "config.json").is_file():
        from setdiff_megatron.hf.load import load_hf_export

        config, state_dict, tokenizer = load_hf_export(source)
        return config, state_dict, tokenizer, None, None
    raise UserError(f"{source} is neither a setdiff checkpoint (a run directory or step_* directory) nor a "
                    "Hugging Face export (a directory with config.json)")


def _megatron_shard(config: ModelConfig, state_dict, step_dir: Path | None, tp: int, dtype: torch.dtype,
                    device: torch.device):
    """This rank's TP shard of the megatron model, weights loaded."""
    from setdiff_megatron.training.megatron_cpu import auto_cpu_mode, model_parallel_seed, quiet_known_warnings

    quiet_known_warnings()
    from megatron.core import dist_checkpointing, parallel_state

    from setdiff_megatron.models.megatron_model import build_model_chunks, transformer_config_from
    from setdiff_megatron.models.weight_maps import torch_to_megatron

    auto_cpu_mode()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp)
    elif (held := parallel_state.get_tensor_model_parallel_world_size()) != tp:  # a second model in this process
        raise UserError(f"this process already holds a model at TP={held}; it cannot load another at TP={tp}")
    model_parallel_seed(0)
    (chunk,) = build_model_chunks(config, transformer_config_from(config, tp=tp, params_dtype=dtype))
    if step_dir is not None:
        loaded = dist_checkpointing.load({"model0": chunk.sharded_state_dict(prefix="")}, str(step_dir))
        chunk.load_state_dict(loaded["model0"])
    else:
        chunk.load_state_dict(torch_to_megatron(state_dict, config, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                                tp_size=tp))
    return chunk.to(device).eval()


def load_sampling_model(source: str | Path, ranks: Ranks, *, device: str = "auto",
                        dtype: str | None = None) -> SamplingModel:
    source = Path(source)
    if not source.exists():
        raise UserError(f"model source {source} does not exist")
    where = _device(device)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    torch_dtype = DTYPES[dtype or ("bf16" if where.type == "cuda" else "fp32")]
    sharded = ranks.tp > 1
    config, state_dict, tokenizer, recipe, step_dir = _read_source(source, weights=not sharded)
    if sharded:
        model = _megatron_shard(config, state_dict, step_dir, ranks.tp, torch_dtype, where)
    else:
        model = SetDiffusionTransformer(config)
        model.load_state_dict(state_dict)
        model = model.to(device=where, dtype=torch_dtype).eval()
    add_bos = recipe is not None and recipe.method.keep_clean_bos
    return SamplingModel(model=model, config=config, tokenizer=tokenizer, add_bos=add_bos, source=source,
                         recipe=recipe)
