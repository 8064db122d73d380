"""The model a sampling or evaluation job runs, from any source `sources.read_source` reads,
as the torch model (TP=1) or as the megatron model split over TP ranks.

At TP=1 every process holds the whole torch model: nothing of megatron is imported, and data
parallelism is just each process taking its own prompts. At TP > 1 the megatron model is built
on distributed.runtime's model-parallel groups and each rank loads only its own shard of a
megatron checkpoint through dist_checkpointing (any other source is read whole and split by the
weight map). Both bodies implement the sampler's `StepModel`; the megatron one gathers its
logits over TP, so every rank of a TP group decides the same tokens.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from setdiff_megatron.data.supervised import RowFormat
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.distributed.runtime import Ranks
from setdiff_megatron.errors import UserError
from setdiff_megatron.log import say
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.dtypes import dtype_named
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipe_data import prompt_format
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.samplers import sampler_for
from setdiff_megatron.sampling.step_runner import StepModel
from setdiff_megatron.sources.read import Source, read_source

__all__ = ["SamplingModel", "load_sampling_model"]


@dataclass
class SamplingModel:
    model: StepModel
    config: ModelConfig
    tokenizer: SetDiffTokenizer
    add_bos: bool
    """The training data started each sample with a clean BOS (recipe method.keep_clean_bos)."""
    recipe: Recipe | None
    """The recipe a checkpoint was trained with (None for a Hugging Face directory)."""
    decoding: DecodingConfig
    """The model's own decoding policy (Source.decoding): what a job decodes with unless told otherwise."""
    family: str = "set_diffusion"
    """Which decoder it takes (Source.family)."""
    trained_length: int = 0
    """The rows it was trained on (Source.trained_length)."""

    def sampler(self, *, context_len: int | None = None, max_rows: int | None = None, **options):
        """The engine that decodes this model (sampling/samplers.py), over its whole context (a
        baseline: the rows it was trained on, its decoder's window) unless `context_len` says
        less; `options` as sampler_for takes them."""
        whole = self.config.max_seq_len if self.family == "set_diffusion" else self.trained_length
        return sampler_for(
            self.family,
            self.model,
            mask_token_id=self.tokenizer.mask_id,
            context_len=min(context_len or whole, whole),
            max_rows=max_rows,
            **options,
        )

    def prompt_format(self, add_bos: bool | None = None) -> RowFormat:
        """How prompts are formatted: as the training recipe's rows began (BOS, a prompt EOS,
        truncation), with `add_bos` over its BOS when given."""
        return prompt_format(self.recipe, self.tokenizer, self.add_bos if add_bos is None else add_bos)


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda: no GPU is visible to this process; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device(name)


def _megatron_shard(source: Source, tp: int, dtype: torch.dtype, device: torch.device):
    """This rank's TP shard of the megatron model, weights loaded."""
    from setdiff_megatron.distributed.layout import Layout
    from setdiff_megatron.distributed.runtime import init_model_parallel, model_parallel_ranks, world_size

    init_model_parallel(Layout.of(world_size(), tp=tp), seed=0)
    from setdiff_megatron.checkpoint.megatron_shards import load_model_shard
    from setdiff_megatron.models.megatron_forward import build_model_chunks, transformer_config_from
    from setdiff_megatron.models.weight_maps.megatron_map import torch_to_megatron

    config = source.config
    (chunk,) = build_model_chunks(config, transformer_config_from(config, tp=tp, params_dtype=dtype))
    if source.state_dict is None:
        load_model_shard(chunk, source.path, ema=source.averaged)
    else:
        chunk.load_state_dict(
            torch_to_megatron(source.state_dict, config, tp_size=tp, tp_rank=model_parallel_ranks()[0])
        )
    return chunk.to(device).eval()


def load_sampling_model(
    path: str | Path | Source, ranks: Ranks, *, device: str = "auto", dtype: str | None = None
) -> SamplingModel:
    """The model of `path`, or of a Source already read (with its weights, or a megatron
    checkpoint's metadata only, whose shards each TP rank then loads)."""
    where = _device(device)
    torch_dtype = dtype_named(dtype or ("bf16" if where.type == "cuda" else "fp32"))
    sharded = ranks.tp > 1
    source = path if isinstance(path, Source) else read_source(path, weights=not sharded)
    if source.state_dict is None and not (sharded and source.kind == "megatron" and not source.lora):
        source = read_source(source.path)  # only megatron shards load rank by rank (LoRA's: merged whole)
    for note in source.notes:  # what a release's reader ignored (its source files, ...)
        say(f"setdiff: {note}", file=sys.stderr)
    if sharded:
        model = _megatron_shard(source, ranks.tp, torch_dtype, where)
    else:
        model = SetDiffusionTransformer(source.config)
        model.load_state_dict(source.state_dict)
        model = model.to(device=where, dtype=torch_dtype).eval()
    return SamplingModel(
        model=model,
        config=source.config,
        tokenizer=source.tokenizer,
        add_bos=source.add_bos,
        recipe=source.recipe,
        decoding=source.decoding,
        family=source.family,
        trained_length=source.trained_length,
    )
