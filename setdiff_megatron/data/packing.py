"""The megatron-core dataset classes of set diffusion (imports megatron-core): packed pretraining
windows (GPTDataset adjusted), supervised records (a MegatronDataset of our own, so megatron's
builder splits and blends them like any other), and the builder.

Kept apart from `samples.py` so that importing the sample API stays cheap and megatron-free until
packed pretraining samples are actually built; module-level classes also pickle into DataLoader
workers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from setdiff_megatron.data.indexed import megatron_datasets
from setdiff_megatron.data.supervised import RowFormat
from setdiff_megatron.errors import UserError

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


_megatron_dataset = megatron_datasets("megatron_dataset")
_config = megatron_datasets("blended_megatron_dataset_config")


@dataclasses.dataclass(kw_only=True)
class SupervisedDatasetConfig(_config.BlendedMegatronDatasetConfig):
    """megatron's dataset config plus how supervised records become rows (data/supervised.py)."""

    row_format: RowFormat
    layout: str = "padded"
    """'padded': one record per row; 'packed': consecutive records fill a row, padding its tail."""


class SupervisedDataset(_megatron_dataset.MegatronDataset):
    """Rows of supervised records from a `setdiff preprocess --supervised` dataset, epoch after
    epoch.

    The split's records are shuffled anew every epoch (seed, epoch); a padded row is one record,
    a packed row the next records of the epoch that fit L (a row never spans epochs). Row i is a
    pure function of (seed, i), so a resume at any sample continues exactly. `num_samples` rows
    are served (None: one epoch). Building checks every record of the split at once: a prompt
    that leaves no room for a response is an error naming its input line.
    """

    def __init__(
        self,
        indexed: Any,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: Any,
        config: SupervisedDatasetConfig,
    ) -> None:
        super().__init__(indexed, dataset_path, indices, num_samples, index_split, config)
        self.unique_identifiers["row_format"] = dataclasses.asdict(config.row_format)  # a blend's cache key
        fmt, length = config.row_format, config.sequence_length
        seq = indexed.sequence_lengths
        first = indexed.document_indices[indices]  # each record's prompt sequence; its response follows
        self._prompt_seq = first.astype(np.int64)
        prompts = fmt.prompt_lengths(seq[first])
        full = prompts >= length
        if full.any():
            raise UserError(
                self._where(int(indices[full.argmax()])) + f": the prompt ({int(prompts[full.argmax()])} "
                f"tokens) fills all {length} positions, no room for a response; raise data.seq_len or "
                "set data.supervised.max_prompt_tokens"
            )
        responses = fmt.response_lengths(seq[first + 1], length - prompts)
        self.num_truncated = int((responses < seq[first + 1]).sum())
        self._prompt_len, self._response_len = prompts, responses
        self._order, self._row_starts = self._rows(num_samples)

    def _where(self, document: int) -> str:
        from setdiff_megatron.data.indexed import locations_path, read_manifest

        prefix = Path(self.dataset_path)
        source = (read_manifest(prefix) or {}).get("source", {}).get("path", str(prefix))
        line = int(np.load(locations_path(prefix), mmap_mode="r")[document])
        return f"{source}:{line}"

    def _rows(self, wanted: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(records of every epoch in order [n], row starts into it [rows + 1]): epochs until
        `wanted` rows exist (None: one epoch)."""
        orders, starts, rows, epoch, offset = [], [np.zeros(1, dtype=np.int64)], 0, 0, 0
        sizes = self._prompt_len + self._response_len
        while (epoch == 0 if wanted is None else rows < wanted) and len(self.indices):
            order = np.random.default_rng([self.config.random_seed, epoch]).permutation(len(self.indices))
            if self.config.layout == "padded":
                epoch_starts = np.arange(1, len(order) + 1, dtype=np.int64)
            else:
                epoch_starts = _pack(sizes[order], self.config.sequence_length)
            orders.append(order)
            starts.append(epoch_starts + offset)
            rows, epoch, offset = rows + len(epoch_starts), epoch + 1, offset + len(order)
        return np.concatenate(orders or [np.zeros(0, dtype=np.int64)]), np.concatenate(starts)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return len(low_level_dataset.document_indices) - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: SupervisedDatasetConfig) -> Any:
        return megatron_datasets("indexed_dataset").IndexedDataset(dataset_path)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return [*_megatron_dataset.MegatronDataset._key_config_attributes(), "layout"]

    def __len__(self) -> int:
        rows = len(self._row_starts) - 1
        return rows if self.num_samples is None else min(rows, self.num_samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        fmt, length, tok = self.config.row_format, self.config.sequence_length, self.config.tokenizer
        tokens = np.full(length, tok.pad_id, dtype=np.int64)
        prompt = np.zeros(length, dtype=bool)
        documents = np.zeros(length, dtype=np.int64)
        positions = np.zeros(length, dtype=np.int64)
        used = 0
        for number, record in enumerate(self._order[self._row_starts[index] : self._row_starts[index + 1]]):
            seq = int(self._prompt_seq[record])
            head = fmt.prompt(self.dataset[seq])
            body = fmt.response(self.dataset[seq + 1], int(self._response_len[record]), tok.eos_id)
            span = len(head) + len(body)
            tokens[used : used + span] = np.concatenate([head, body])
            prompt[used : used + len(head)] = True
            documents[used : used + span] = number
            positions[used : used + span] = np.arange(span)
            used += span
        sample = {
            "tokens": torch.from_numpy(tokens),
            "prompt_mask": torch.from_numpy(prompt),
            "pad_mask": torch.from_numpy(np.arange(length) >= used),
        }
        if self.config.layout == "packed":
            sample |= {"document_ids": torch.from_numpy(documents), "position_ids": torch.from_numpy(positions)}
        return sample


def _pack(sizes: np.ndarray, length: int) -> np.ndarray:
    """End offsets of greedy rows: records in order, a new row when the next does not fit."""
    ends, used = [], 0
    for i, size in enumerate(sizes.tolist()):
        if used + size > length:
            ends.append(i)
            used = 0
        used += size
    ends.append(len(sizes))
    return np.array(ends, dtype=np.int64)
