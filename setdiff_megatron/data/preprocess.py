"""Preprocessing: raw corpora in, megatron-core indexed datasets (`.bin/.idx` + manifest) out.

Megatron-LM's `tools/preprocess_data.py` job for set diffusion: each input becomes one dataset
`<output_dir>/<input name>` of its documents tokenized with EOS appended (a supervised record as
two sequences, prompt and response), and the tokenizer goes to `<output_dir>/tokenizer/`, so
training and sampling load exactly what produced the tokens. Workers parse and tokenize; the
main process writes in input order, with bounded memory. A rerun skips every output whose
manifest matches the input's sha256, the tokenizer and the options. docs/data.md ("Preprocessing").
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from setdiff_megatron.data.indexed import IndexedWriter, ensure_writable_dir, read_manifest
from setdiff_megatron.data.sources import (
    BadRecord,
    RecordBatch,
    Source,
    detect_source,
    read_batches,
    record_fields,
    record_text,
    source_sha256,
)
from setdiff_megatron.data.supervised import RecordFields, check_chat_template, encode_record
from setdiff_megatron.data.tokenizers import SETDIFF_FILE, SetDiffTokenizer, load_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.log import say
from setdiff_megatron.progress import progress_bar

TOKENIZER_SUBDIR = "tokenizer"
_MAX_REPORTED_BAD = 10


@dataclass(kw_only=True, slots=True)
class PreprocessOptions:
    """How inputs are read and processed."""

    text_field: str = "text"
    """JSONL field / Parquet or datasets column holding the document."""
    text_unit: str = "paragraph"
    """Plain text only: "paragraph" (blank-line separated documents) or "line"."""
    on_bad_line: str = "stop"
    """"stop" at the first unreadable record, or "skip" it (reported, counted in the manifest)."""
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    """Tokenizing processes; 1 tokenizes in the calling process."""
    batch_bytes: int = 1 << 20
    """Raw bytes per batch handed to a worker."""
    progress: bool = True
    """Show a progress bar (documents/s, tokens/s) and a summary on stderr."""
    supervised: RecordFields | None = None
    """Write prompt/response records (data/supervised.py) instead of pretraining documents."""

    def __post_init__(self) -> None:
        if self.text_unit not in ("paragraph", "line"):
            raise UserError(f"text_unit must be 'paragraph' or 'line', not {self.text_unit!r}")
        if self.on_bad_line not in ("stop", "skip"):
            raise UserError(f"on_bad_line must be 'stop' or 'skip', not {self.on_bad_line!r}")
        if self.workers < 1 or self.batch_bytes < 1:
            raise UserError("workers and batch_bytes must be positive")

    def recorded(self, source: Source) -> dict[str, Any]:
        """The options that shape `source`'s tokens (a change makes a rerun rebuild it)."""
        if self.supervised is not None:
            return self.supervised.recorded()
        if source.kind == "text":
            return {"text_unit": self.text_unit}
        return {"text_field": self.text_field}

    @property
    def fields(self) -> tuple[str, ...]:
        return self.supervised.names if self.supervised is not None else (self.text_field,)


def preprocess(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    tokenizer: SetDiffTokenizer,
    options: PreprocessOptions,
) -> list[dict[str, Any]]:
    """Preprocess every input into `output_dir`; return their manifests (skipped ones included).

    All inputs are checked before any work starts, so a typo in the last path fails fast.
    """
    output_dir = Path(output_dir)
    if not inputs:
        raise UserError("no inputs given")
    sources = [detect_source(path) for path in inputs]
    if options.supervised is not None:
        if any(source.kind == "text" for source in sources):
            raise UserError("supervised records need fields: give .jsonl, .parquet or datasets inputs, not plain text")
        check_chat_template(options.supervised, tokenizer, "the tokenizer")
    names = [source.name for source in sources]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise UserError(f"several inputs would write the same output name: {', '.join(duplicates)}")
    ensure_writable_dir(output_dir)
    _store_tokenizer(output_dir / TOKENIZER_SUBDIR, tokenizer)
    return [_preprocess_source(source, output_dir, tokenizer, options) for source in sources]


def _preprocess_source(
    source: Source, output_dir: Path, tokenizer: SetDiffTokenizer, options: PreprocessOptions
) -> dict[str, Any]:
    """Write one input's indexed dataset, or return its manifest if it is already finished."""
    prefix = output_dir / source.name
    provenance = {
        "source": {"path": str(source.path.resolve()), "kind": source.kind, "sha256": source_sha256(source)},
        "options": options.recorded(source),
        "tokenizer": tokenizer.identity(),
    }
    old = read_manifest(prefix)
    if (
        old is not None
        and old["source"]["sha256"] == provenance["source"]["sha256"]
        and old["options"] == provenance["options"]
        and old["tokenizer"] == provenance["tokenizer"]
    ):
        _note(options, f"{source.name}: up to date ({old['documents']} documents), skipped")
        return old

    counts = {"documents": 0, "tokens": 0, "skipped_bad_records": 0, "skipped_empty_documents": 0}
    supervised = options.supervised is not None
    if supervised:
        provenance["kind"] = "supervised"
        counts["prompt_tokens"] = 0
    batches = _encoded_batches(source, tokenizer, output_dir / TOKENIZER_SUBDIR, options)
    with (
        IndexedWriter(prefix, tokenizer.vocab_size, keep_locations=supervised) as writer,
        contextlib.closing(batches) as stream,
        progress_bar(desc=source.name, unit="doc", disable=not options.progress, file=sys.stderr) as bar,
    ):
        start = time.perf_counter()
        for encoded in stream:
            for location, reason in encoded.bad:
                where = source.where(location)
                if options.on_bad_line == "stop":
                    raise UserError(f"{where}: {reason} (--on-bad-line skip skips such records)")
                counts["skipped_bad_records"] += 1
                if counts["skipped_bad_records"] <= _MAX_REPORTED_BAD:
                    bar.write(f"skipping {where}: {reason}", file=sys.stderr)
            ends = np.cumsum(encoded.lengths)
            for i, (begin, end) in enumerate(zip(ends - encoded.lengths, ends)):
                if supervised:
                    prompt = int(encoded.prompt_lengths[i])
                    writer.add_document(
                        encoded.ids[begin:end], [prompt, end - begin - prompt], location=int(encoded.locations[i])
                    )
                else:
                    writer.add_document(encoded.ids[begin:end])
            if supervised:
                counts["prompt_tokens"] += int(encoded.prompt_lengths.sum())
            counts["documents"] += len(encoded.lengths)
            counts["tokens"] += int(encoded.ids.size)
            counts["skipped_empty_documents"] += encoded.empty
            rate = counts["tokens"] / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate:,.0f} tok/s, {encoded.done:.0%} read", refresh=False)
            bar.update(len(encoded.lengths))
        if counts["documents"] == 0:
            raise UserError(f"{source.path}: no documents found (empty corpus)")
        seconds = time.perf_counter() - start
        manifest = writer.commit({"name": source.name, **provenance, **counts, "seconds": round(seconds, 3)})
    skipped = counts["skipped_bad_records"]
    _note(
        options,
        f"{source.name}: {counts['documents']} documents, {counts['tokens']} tokens in {seconds:.1f}s "
        f"({counts['documents'] / seconds:,.0f} doc/s, {counts['tokens'] / seconds:,.0f} tok/s)"
        + (f", {skipped} bad records skipped" if skipped else ""),
    )
    return manifest


@dataclass(slots=True)
class EncodedBatch:
    """One batch's documents, tokenized: concatenated ids (EOS after each) and their lengths;
    supervised records also carry their prompt lengths and input locations."""

    ids: np.ndarray
    lengths: np.ndarray
    bad: list[tuple[int, str]]  # (location, reason) of records that are not documents
    empty: int
    done: float
    prompt_lengths: np.ndarray | None = None
    locations: np.ndarray | None = None


def _flat(encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    return np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum())), lengths


@dataclass(frozen=True, slots=True)
class _Encoder:
    """Parses and tokenizes one RecordBatch, in the worker processes or in this one."""

    tokenizer: SetDiffTokenizer
    text_field: str
    supervised: RecordFields | None = None

    def __call__(self, batch: RecordBatch) -> EncodedBatch:
        if self.supervised is not None:
            return self._records(batch)
        texts, bad, empty = [], [], 0
        for location, payload in zip(batch.locations, batch.payloads):
            try:
                text = record_text(batch.kind, payload, self.text_field)
            except BadRecord as exc:
                bad.append((location, str(exc)))
                continue
            if text:
                texts.append(text)
            else:
                empty += 1
        eos = [self.tokenizer.eos_id]
        ids, lengths = _flat([ids + eos for ids in self.tokenizer.encode_batch(texts)])
        return EncodedBatch(ids, lengths, bad, empty, batch.done)

    def _records(self, batch: RecordBatch) -> EncodedBatch:
        documents, prompts, locations, bad = [], [], [], []
        for location, payload in zip(batch.locations, batch.payloads):
            try:
                prompt, response = encode_record(
                    record_fields(batch.kind, payload, self.supervised.names), self.supervised, self.tokenizer
                )
            except BadRecord as exc:
                bad.append((location, str(exc)))
                continue
            documents.append(prompt + response)
            prompts.append(len(prompt))
            locations.append(location)
        ids, lengths = _flat(documents)
        return EncodedBatch(
            ids, lengths, bad, 0, batch.done, np.array(prompts, dtype=np.int64), np.array(locations, dtype=np.int64)
        )


_worker_encoder: _Encoder | None = None


def _init_worker(tokenizer_dir: Path, text_field: str, supervised: RecordFields | None) -> None:
    global _worker_encoder
    # Parallelism comes from the processes; a Rust thread pool per worker would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = _Encoder(load_tokenizer(tokenizer_dir), text_field, supervised)


def _encode_in_worker(batch: RecordBatch) -> EncodedBatch:
    return _worker_encoder(batch)


def _encoded_batches(
    source: Source, tokenizer: SetDiffTokenizer, tokenizer_dir: Path, options: PreprocessOptions
) -> Iterator[EncodedBatch]:
    """Encoded batches in input order, at most `2 * workers` in flight.

    Not Pool.imap: its feeder thread reads the input ahead without limit. Not multiprocessing.Pool
    at all: it respawns a worker that dies at start-up forever, where ProcessPoolExecutor raises.
    Workers load the tokenizer saved in `tokenizer_dir` (the same one, by sha256) rather than
    receive it pickled: a large start-up payload can block the parent forever when a spawned
    child dies before reading it (CPython 3.11).
    """
    batches = read_batches(source, fields=options.fields, text_unit=options.text_unit, batch_bytes=options.batch_bytes)
    if options.workers == 1:
        yield from map(_Encoder(tokenizer, options.text_field, options.supervised), batches)
        return
    # Spawned, not forked: the parent may hold torch, megatron and tokenizer thread pools, which a
    # fork would copy mid-flight.
    context = multiprocessing.get_context("spawn")
    init = (tokenizer_dir, options.text_field, options.supervised)
    with ProcessPoolExecutor(options.workers, context, initializer=_init_worker, initargs=init) as pool:
        pending: deque[Future] = deque()
        try:
            for batch in batches:
                pending.append(pool.submit(_encode_in_worker, batch))
                if len(pending) >= 2 * options.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _store_tokenizer(directory: Path, tokenizer: SetDiffTokenizer) -> None:
    """Save the tokenizer beside the datasets; refuse to mix datasets of different tokenizers."""
    if (directory / SETDIFF_FILE).is_file():
        if load_tokenizer(directory).sha256 != tokenizer.sha256:
            raise UserError(
                f"{directory} holds a different tokenizer: datasets in one output directory must "
                "share one tokenizer (use another --output-dir)"
            )
        return
    tokenizer.save(directory)


def _note(options: PreprocessOptions, message: str) -> None:
    if options.progress:
        say(message, file=sys.stderr)
