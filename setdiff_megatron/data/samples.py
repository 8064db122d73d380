"""Training samples for set diffusion, built on megatron-core's GPTDataset and blending.

Pretraining samples come from megatron-core unchanged in substance: `BlendedMegatronDatasetBuilder`
splits each preprocessed dataset into train/valid/test by document ranges (`split="969,30,1"`),
`GPTDataset` shuffles documents with `seed`, packs them into windows of exactly the requested
length, and `BlendedDataset` mixes several datasets by weight. Its index files are cached under
`cache_dir` (pass the run directory), and everything works without torch.distributed.

Packing, as documented for users: a sample is a window of the stream of shuffled documents, each
document followed by its EOS. Windows cross document boundaries (EOS marks them; nothing is reset
or padded), so a sample may begin and end mid-document. Set diffusion sees the whole window.

What set diffusion adds on top (the `PackedSamples` view):
- no labels: the targets are the clean tokens themselves, so megatron's shifted labels, loss mask
  and pad-id rewriting are dropped (`add_extra_token_to_sequence=False`, windows of exactly L);
- `prepend_bos`: position 0 holds BOS and the packed content is one token shorter; BOS is marked
  in `prompt_mask`, so the order policy pins it as clean context and the loss skips it;
- every sample is a dict of `tokens [L]` int64, `prompt_mask [L]` bool, `pad_mask [L]` bool.

Supervised adaptation data (`PromptResponseDataset`): prompt tokens become pinned context
(`prompt_mask`), the response plus EOS is the target, and right padding is marked in `pad_mask`
(padding goes last in every order and carries no loss).

Resumption is exact: `ResumableLoader` hands out micro-batches in the global sample order of
Megatron-LM's pretraining sampler and its `state_dict()` counts the samples actually delivered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from setdiff_megatron.data.indexed import read_manifest
from setdiff_megatron.data.sources import BadRecord, record_text
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError

SPLITS = ("train", "valid", "test")
Sample = dict[str, torch.Tensor]


class PackedSamples(torch.utils.data.Dataset):
    """A megatron-core dataset (GPTDataset or BlendedDataset) seen as set diffusion samples."""

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


def build_packed_datasets(
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
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> dict[str, PackedSamples | None]:
    """Train/valid/test `PackedSamples` from preprocessed dataset prefixes.

    `num_samples` is the number of samples wanted per split (None: one epoch); a weighted blend
    of several prefixes needs a number for every split, as megatron-core requires. A split whose
    share in `split` is zero comes back as None.
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
    for prefix in prefixes:
        manifest = read_manifest(Path(prefix))
        if manifest is None:
            raise UserError(f"{prefix} is not a finished preprocessed dataset; run setdiff preprocess")
        if manifest["tokenizer"]["sha256"] != tokenizer.sha256:
            raise UserError(f"{prefix} was tokenized with a different tokenizer than the one given")

    from setdiff_megatron.data import packing  # imports megatron-core (seconds), so only now

    config = packing.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=sequence_length - int(prepend_bos),
        blend=([str(p) for p in prefixes], None if weights is None else [float(w) for w in weights]),
        split=split,
        path_to_cache=str(cache_dir),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        add_extra_token_to_sequence=False,
    )
    builder = packing.SingleProcessSafeBuilder(
        packing.PackedTokenDataset, list(num_samples), is_built_on_rank, config
    )
    datasets = builder.build()
    bos_id = tokenizer.bos_id if prepend_bos else None
    return {s: None if ds is None else PackedSamples(ds, bos_id=bos_id) for s, ds in zip(SPLITS, datasets)}


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
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, num_workers=self.num_workers
        )
        for batch in loader:
            self.consumed_samples += sampler.global_batch_size
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


class PromptResponseDataset(torch.utils.data.Dataset):
    """Supervised adaptation records from a JSONL of {"prompt": ..., "response": ...}.

    Each record becomes [BOS] prompt response EOS PAD... of exactly `sequence_length` tokens,
    right-padded. `prompt_mask` covers BOS and the prompt (pinned context), `pad_mask` the
    padding. A response that does not fit is cut on the right (its EOS too) and counted in
    `num_truncated`; a prompt that leaves no room for a response token is an error. The file is
    read whole: supervised sets are small next to pretraining corpora.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: SetDiffTokenizer,
        *,
        sequence_length: int,
        prompt_field: str = "prompt",
        response_field: str = "response",
        prepend_bos: bool = False,
    ):
        path = Path(path)
        if not path.is_file():
            raise UserError(f"input file not found: {path}")
        self.sequence_length = sequence_length
        self.pad_id = tokenizer.pad_id
        self.num_truncated = 0
        self._records: list[tuple[np.ndarray, int]] = []  # (tokens without padding, prompt length)
        head = [tokenizer.bos_id] if prepend_bos else []
        with open(path, "rb") as stream:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    prompt = record_text("jsonl", line, prompt_field)
                    response = record_text("jsonl", line, response_field)
                except BadRecord as exc:
                    raise UserError(f"{path}:{number}: {exc}") from None
                context = head + tokenizer.encode(prompt)
                if len(context) >= sequence_length:
                    raise UserError(
                        f"{path}:{number}: the prompt fills all {sequence_length} positions, "
                        "no room for a response"
                    )
                target = tokenizer.encode(response) + [tokenizer.eos_id]
                room = sequence_length - len(context)
                self.num_truncated += len(target) > room
                self._records.append((np.array(context + target[:room], dtype=np.int64), len(context)))
        if not self._records:
            raise UserError(f"{path}: no prompt/response records found")

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> Sample:
        ids, prompt_length = self._records[index]
        tokens = torch.full((self.sequence_length,), self.pad_id, dtype=torch.int64)
        tokens[: len(ids)] = torch.from_numpy(ids)
        positions = torch.arange(self.sequence_length)
        return {"tokens": tokens, "prompt_mask": positions < prompt_length, "pad_mask": positions >= len(ids)}
