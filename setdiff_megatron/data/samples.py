"""Training samples for set diffusion, built on megatron-core's GPTDataset and blending.

`build_datasets` splits, shuffles and blends preprocessed datasets through megatron-core's
`BlendedMegatronDatasetBuilder`, unchanged in substance, into packed pretraining windows
(`PackedSamples`) or supervised rows (`packing.SupervisedDataset`). A sample is a dict of
`tokens [L]` int64, `prompt_mask [L]` bool and `pad_mask [L]` bool, with no labels: the targets
are the clean tokens themselves. Nothing here needs torch.distributed. How rows are made, split,
blended and resumed: docs/data.md ("Samples, splits, blends and epochs").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.data.indexed import dataset_kind, read_manifest
from setdiff_megatron.data.supervised import RowFormat
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError

SPLITS = ("train", "valid", "test")
Sample = dict[str, torch.Tensor]


class PackedSamples(torch.utils.data.Dataset):
    """A megatron-core dataset (GPTDataset or BlendedDataset) seen as set diffusion samples.

    A sample is a window of the stream of shuffled documents, each followed by its EOS; windows
    cross document boundaries (EOS marks them; nothing is reset or padded), so a sample may begin
    and end mid-document, and set diffusion sees the whole window. With `bos_id`, position 0 holds
    BOS and the packed content is one token shorter; BOS is marked in `prompt_mask`, so the order
    policy pins it as clean context and the loss skips it.
    """

    def __init__(self, megatron_dataset: Any, *, bos_id: int | None):
        self.megatron_dataset = megatron_dataset
        self.bos_id = bos_id

    def __len__(self) -> int:
        return len(self.megatron_dataset)

    def __getitem__(self, index: int) -> Sample:
        content = self.megatron_dataset[index]["tokens"]
        if self.bos_id is not None:
            content = torch.cat([torch.tensor([self.bos_id], dtype=torch.int64), content])
        prompt_mask = torch.zeros(content.shape, dtype=torch.bool)
        prompt_mask[0] = self.bos_id is not None
        pad_mask = torch.zeros(content.shape, dtype=torch.bool)  # packed windows are never padded
        return {"tokens": content, "prompt_mask": prompt_mask, "pad_mask": pad_mask}


@dataclass(frozen=True)
class SupervisedRows:
    """How supervised records fill rows: their `RowFormat` and the layout ('padded' or 'packed')."""

    row_format: RowFormat
    layout: str = "padded"


def build_datasets(
    prefixes: Sequence[str | Path],
    tokenizer: SetDiffTokenizer,
    *,
    sequence_length: int,
    cache_dir: str | Path,
    num_samples: Sequence[int | None] = (None, None, None),
    split: str = "969,30,1",
    weights: Sequence[float] | None = None,
    seed: int = 1234,
    prepend_bos: bool = False,
    supervised: SupervisedRows | None = None,
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> dict[str, torch.utils.data.Dataset | None]:
    """Train/valid/test samples from preprocessed dataset prefixes: packed pretraining windows
    (`PackedSamples`), or supervised rows when `supervised` is given.

    megatron-core caches its index files under `cache_dir` (pass the run directory).
    `num_samples` is the number of samples wanted per split (None: one epoch); a weighted blend
    of several prefixes needs a number for every split, as megatron-core requires. A split whose
    share in `split` is zero comes back as None. `prepend_bos` applies to packed windows; a
    supervised row's BOS is its `RowFormat`'s.
    """
    if len(prefixes) == 0:
        raise UserError("no datasets to build samples from")
    if sequence_length < 2:
        raise UserError("sequence_length must be at least 2")
    if len(num_samples) != len(SPLITS):
        raise UserError("num_samples needs one entry per split (train, valid, test)")
    weights = None if len(prefixes) == 1 else weights
    if weights is not None and (len(weights) != len(prefixes) or any(s is None for s in num_samples)):
        raise UserError("a weighted blend needs one weight per dataset and num_samples for every split")
    wanted = "supervised" if supervised is not None else "pretraining"
    for prefix in prefixes:
        manifest = read_manifest(Path(prefix))
        if manifest is None:
            raise UserError(f"{prefix} is not a finished preprocessed dataset; run setdiff preprocess")
        if manifest["tokenizer"]["sha256"] != tokenizer.sha256:
            raise UserError(f"{prefix} was tokenized with a different tokenizer than the one given")
        if dataset_kind(manifest) != wanted:
            raise UserError(
                f"{prefix} holds {dataset_kind(manifest)} data, not {wanted}: set its data.datasets "
                f"entry's format to {dataset_kind(manifest)} (or preprocess it"
                f"{' with --supervised' if wanted == 'supervised' else ' without --supervised'})"
            )

    from setdiff_megatron.data import packing  # imports megatron-core (seconds), so only now

    common = dict(
        random_seed=seed,
        blend=([str(p) for p in prefixes], None if weights is None else [float(w) for w in weights]),
        split=split,
        path_to_cache=str(cache_dir),
        tokenizer=tokenizer,
    )
    if supervised is not None:
        cls = packing.SupervisedDataset
        config = packing.SupervisedDatasetConfig(
            sequence_length=sequence_length, row_format=supervised.row_format, layout=supervised.layout, **common
        )
    else:
        cls = packing.PackedTokenDataset
        # No labels: the targets are the clean tokens themselves, so megatron's shifted labels, loss
        # mask and pad-id rewriting are dropped, and windows are exactly L tokens long.
        config = packing.GPTDatasetConfig(
            sequence_length=sequence_length - int(prepend_bos),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            add_extra_token_to_sequence=False,
            **common,
        )
    datasets = packing.SingleProcessSafeBuilder(cls, list(num_samples), is_built_on_rank, config).build()
    if supervised is not None:
        return dict(zip(SPLITS, datasets))
    bos_id = tokenizer.bos_id if prepend_bos else None
    return {s: None if ds is None else PackedSamples(ds, bos_id=bos_id) for s, ds in zip(SPLITS, datasets)}


def truncation_report(dataset: Any) -> tuple[int, int]:
    """(responses cut to fit, records) over a supervised split, a blend's members included."""
    members = getattr(dataset, "datasets", [dataset])
    return (sum(getattr(m, "num_truncated", 0) for m in members), sum(len(getattr(m, "indices", ())) for m in members))


class PretrainingBatchSampler:
    """Micro-batches of sample indices for one data-parallel rank, from `consumed_samples` on.

    Megatron-LM's pretraining order: global batch g covers samples [g*B, (g+1)*B) with
    B = micro_batch_size * dp_size, and rank r takes the r-th micro-batch of it. An incomplete
    final global batch is dropped.
    """

    def __init__(
        self,
        total_samples: int,
        *,
        micro_batch_size: int,
        consumed_samples: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if not 0 <= dp_rank < dp_size or micro_batch_size < 1:
            raise UserError("need micro_batch_size >= 1 and 0 <= dp_rank < dp_size")
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.consumed_samples = consumed_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        return max(self.total_samples - self.consumed_samples, 0) // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for batch in range(len(self)):
            first = start + batch * self.global_batch_size
            yield list(range(first, first + self.micro_batch_size))


class ResumableLoader:
    """A DataLoader over `PretrainingBatchSampler` whose state is the samples delivered so far.

    The count advances when a batch reaches the caller, not when a worker prefetches it, so a
    checkpointed `state_dict()` resumes at exactly the next unseen sample, with any num_workers.
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        *,
        micro_batch_size: int,
        consumed_samples: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        num_workers: int = 0,
    ):
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.consumed_samples = consumed_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_workers = num_workers

    def __iter__(self) -> Iterator[Sample]:
        sampler = PretrainingBatchSampler(
            len(self.dataset),
            micro_batch_size=self.micro_batch_size,
            consumed_samples=self.consumed_samples,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers)
        for batch in loader:
            self.consumed_samples += sampler.global_batch_size
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
