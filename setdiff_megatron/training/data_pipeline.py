"""From a recipe's data and method sections to two-stream micro-batches, for every engine.

The tokenizer and the datasets (packed pretraining windows, or supervised rows) come from
`data/`; the order of each sequence comes from the recipe's order policy through `core.streams`.
Each sample's order (and the baselines' noise) is drawn from a generator seeded by the sample's
index in its dataset, so every tensor- and pipeline-parallel rank of one data-parallel replica
builds the very same batch, a resumed run draws what it would have drawn without the
interruption, and a step's draws do not depend on which rank or micro-batch holds a sample: the
training and validation losses are the same under every layout, engine and micro-batch size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from setdiff_megatron.core.masked_diffusion import masked_two_stream_batch, sample_masked_batch
from setdiff_megatron.core.streams import TwoStreamBatch, concat_batches, sample_two_stream_batch
from setdiff_megatron.data.builtin import builtin_corpus_dir, corpus_paths, prepare_builtin_corpus
from setdiff_megatron.data.samples import ResumableLoader, SupervisedRows, build_datasets, truncation_report
from setdiff_megatron.data.tokenizers import SetDiffTokenizer, load_tokenizer
from setdiff_megatron.log import say
from setdiff_megatron.recipe_data import data_dir, is_supervised, row_format
from setdiff_megatron.recipes.schema import BUILTIN_CORPORA, Recipe

__all__ = ["TrainingData", "prepare_data", "DataLoaders", "model_batch"]


@dataclass
class TrainingData:
    tokenizer: SetDiffTokenizer
    train: torch.utils.data.Dataset
    valid: torch.utils.data.Dataset | None


def prepare_data(
    recipe: Recipe, *, num_train_samples: int, num_valid_samples: int, is_first_rank: bool, barrier=lambda: None
) -> TrainingData:
    """Tokenizer and train/valid samples. The first rank prepares a built-in corpus while
    the others wait at `barrier`; megatron's builder orders the index caches the same way."""
    data, cache = recipe.data, data_dir(recipe)
    names = [d.path for d in data.datasets]
    builtin = len(names) == 1 and names[0] in BUILTIN_CORPORA
    supervised = is_supervised(recipe)
    if builtin:
        corpus_dir = builtin_corpus_dir(names[0], cache, data.vocab_size)
        if is_first_rank:
            prepare_builtin_corpus(names[0], corpus_dir, data.vocab_size, progress=True)
        barrier()  # the other ranks only read what the first one wrote before the barrier
        tokenizer_dir, train_prefix, valid_prefix = corpus_paths(corpus_dir, supervised=supervised)
        tokenizer = load_tokenizer(tokenizer_dir)
        train_sets = [(train_prefix, 1.0)]
        splits = {"train": ("100,0,0", [train_prefix]), "valid": ("0,100,0", [valid_prefix])}
    else:
        tokenizer = load_tokenizer(data.tokenizer)
        train_sets = [(Path(d.path), d.weight) for d in data.datasets]
        splits = {"all": (data.split, [p for p, _ in train_sets])}

    rows = SupervisedRows(row_format(recipe, tokenizer), data.supervised.layout) if supervised else None

    def build(split: str, prefixes: list[Path]) -> dict[str, torch.utils.data.Dataset | None]:
        weights = [w for p, w in train_sets if p in prefixes] if len(prefixes) > 1 else None
        return build_datasets(
            prefixes,
            tokenizer,
            sequence_length=data.seq_len,
            cache_dir=cache / "index",
            num_samples=(num_train_samples, num_valid_samples, 0),
            split=split,
            weights=weights,
            seed=recipe.train.seed,
            prepend_bos=recipe.method.keep_clean_bos,
            supervised=rows,
        )

    # Every rank builds; megatron's builder lets rank 0 write the index caches first.
    built = {name: build(*args) for name, args in splits.items()}
    train, valid = (
        (built["train"]["train"], built["valid"]["valid"])
        if builtin
        else (built["all"]["train"], built["all"]["valid"])
    )
    if supervised and is_first_rank:
        cut, records = truncation_report(train)
        if cut:
            say(
                f"setdiff: data: {cut} of {records} training responses are cut to fit data.seq_len = {data.seq_len}"
                + (" (EOS kept last: data.supervised.force_eos)" if data.supervised.force_eos else "")
            )
    return TrainingData(tokenizer, train, valid)


class _Indexed(torch.utils.data.Dataset):
    """A dataset whose samples carry their index ("index"), which keys their draws."""

    def __init__(self, dataset: torch.utils.data.Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], "index": index}


class DataLoaders:
    """Per-step lists of two-stream micro-batches for one data-parallel rank."""

    def __init__(
        self,
        recipe: Recipe,
        data: TrainingData,
        *,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
        device: torch.device | str = "cpu",
    ):
        self.recipe, self.data, self.device = recipe, data, torch.device(device)
        self.policy = None if recipe.method.masked_diffusion else recipe.method.order_policy()
        self.dp_rank, self.dp_size = dp_rank, dp_size
        mbs = recipe.parallel.micro_batch_size
        self.num_microbatches = recipe.parallel.global_batch_size // (mbs * dp_size)
        self.train = ResumableLoader(
            _Indexed(data.train),
            micro_batch_size=mbs,
            consumed_samples=consumed_samples,
            dp_rank=dp_rank,
            dp_size=dp_size,
            num_workers=recipe.data.num_workers,
        )
        self._train_iter: Iterator | None = None

    @property
    def consumed_samples(self) -> int:
        return self.train.consumed_samples

    def _keyed_batch(self, sample: dict, tag: int, world_rows: int) -> TwoStreamBatch:
        """The model's batch of `sample` (collated rows with their "index"), each row drawn from a
        generator keyed by (tag, its index); its place among the `world_rows` rows drawn together
        (a step's global batch, or the validation set) is its index modulo them."""
        rows = []
        for r, index in enumerate(sample["index"].tolist()):
            row = {k: v[r : r + 1] for k, v in sample.items() if k != "index"}
            rows.append(self._two_stream(row, self._generator(tag, index), index % world_rows, world_rows))
        return concat_batches(rows)

    def _two_stream(self, sample: dict, generator: torch.Generator, slot: int, world_rows: int) -> TwoStreamBatch:
        tok = self.data.tokenizer
        eod = tok.eod if self.recipe.data.document_mask else None
        return model_batch(self.recipe, self.policy, sample, tok.mask_id, eod, generator, slot, world_rows, self.device)

    def _generator(self, *key: int) -> torch.Generator:
        seed = hash((self.recipe.train.seed, *key)) % (2**63)
        return torch.Generator(device=self.device).manual_seed(seed)

    def next_step(self) -> list[TwoStreamBatch]:
        """The micro-batches of this rank's share of the next global batch."""
        if self._train_iter is None:
            self._train_iter = iter(self.train)
        batches = []
        for _ in range(self.num_microbatches):
            try:
                sample = next(self._train_iter)
            except StopIteration:
                raise RuntimeError("the training dataset ran out of samples; it was built for fewer steps") from None
            batches.append(self._keyed_batch(sample, 0, self.recipe.parallel.global_batch_size))
        return batches

    def valid_batches(self, num_batches: int) -> list[TwoStreamBatch]:
        """This rank's micro-batches of the validation set: its first num_batches x global batch
        size samples, split evenly over the data-parallel ranks, each sample's order and noise
        drawn from its own index. Every layout, engine and micro-batch size sees the same samples
        with the same draws, so the loss depends on the weights only (and resumes compare)."""
        if self.data.valid is None:
            return []
        total = num_batches * self.recipe.parallel.global_batch_size
        per_rank, mbs = total // self.dp_size, self.recipe.parallel.micro_batch_size
        valid, first = _Indexed(self.data.valid), self.dp_rank * per_rank
        return [
            self._keyed_batch(torch.utils.data.default_collate([valid[i] for i in range(start, start + mbs)]), 1, total)
            for start in range(first, first + per_rank, mbs)
        ]


def model_batch(
    recipe: Recipe,
    policy,
    sample: dict,
    mask_id: int,
    eod_id: int | None,
    generator: torch.Generator,
    slot: int,
    world_rows: int,
    device: torch.device,
) -> TwoStreamBatch:
    """The model's batch of `sample` (tokens, prompt and pad masks, and for packed records their
    document and position ids) under the recipe's method; `slot` is its place among the
    `world_rows` rows drawn together, over which the masked-diffusion baselines' antithetic noise
    levels stratify. `policy` is the set diffusion order policy (None for the baselines)."""
    tokens = sample["tokens"].to(device)
    method = recipe.method
    records = None
    if "document_ids" in sample:  # rows that pack supervised records
        records = (sample["document_ids"].to(device), sample["position_ids"].to(device))
    if method.masked_diffusion:
        block_size = method.block_size if method.family == "bd3lm" else None
        prompt = sample["prompt_mask"].to(device)
        if method.keep_clean_bos:  # the reference draws at the BOS like anywhere, then restores it
            prompt = prompt.clone()
            prompt[:, 0] = False
        batch = sample_masked_batch(
            tokens,
            mask_token_id=mask_id,
            block_size=block_size,
            prompt_mask=prompt,
            keep_clean_bos=method.keep_clean_bos,
            pad_mask=sample["pad_mask"].to(device),
            antithetic=method.antithetic,
            rank=slot,
            world_rows=world_rows,
            records=records,
            generator=generator,
        )
        return masked_two_stream_batch(batch, block_size)
    return sample_two_stream_batch(
        tokens,
        policy,
        mask_token_id=mask_id,
        prompt_mask=sample["prompt_mask"].to(device),
        pad_mask=sample["pad_mask"].to(device),
        eod_id=eod_id,
        records=records,
        generator=generator,
    )
