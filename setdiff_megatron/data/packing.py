"""The two megatron-core dataset classes adjusted for set diffusion (imports megatron-core).

Kept apart from `samples.py` so that importing the sample API stays cheap and megatron-free until
packed pretraining samples are actually built; module-level classes also pickle into DataLoader
workers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from setdiff_megatron.data.indexed import megatron_datasets

_gpt_dataset = megatron_datasets("gpt_dataset")
_blended_dataset = megatron_datasets("blended_dataset")
_builder = megatron_datasets("blended_megatron_dataset_builder")

GPTDatasetConfig = _gpt_dataset.GPTDatasetConfig


class PackedTokenDataset(_gpt_dataset.GPTDataset):
    """GPTDataset returning only the packed window of tokens.

    Megatron's labels, loss mask and pad-id rewriting serve next-token prediction; set diffusion
    predicts the clean tokens themselves, and the rewriting would turn real tokens that share the
    pad id into 0.
    """

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, _ = self._query_document_sample_shuffle_indices(index)
        return {"tokens": torch.from_numpy(tokens)}


class SingleProcessSafeBuilder(_builder.BlendedMegatronDatasetBuilder):
    """BlendedMegatronDatasetBuilder that also works without a torch.distributed process group.

    megatron-core 0.16.1's BlendedDataset calls torch.distributed.get_rank() on a cache miss even
    when no process group exists. Without one, its blend index (cheap: one pass of C++ over the
    requested samples) is built in memory instead of cached; GPTDataset indices are cached either
    way.
    """

    @staticmethod
    def build_generic_dataset(cls: Any, is_built_on_rank: Any, synchronize_ranks: bool, *args: Any) -> Any:
        if cls is _blended_dataset.BlendedDataset and not torch.distributed.is_initialized():
            *rest, config = args
            args = (*rest, dataclasses.replace(config, path_to_cache=None))
        return _builder.BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )
