"""Input corpora for preprocessing: find a file's format, stream its documents, checksum it.

One dataset per input: JSONL (`.jsonl`, `.json`, `.ndjson`, optionally `.gz`), plain text
(`.txt`, optionally `.gz`), Parquet, or a `datasets` directory saved with `save_to_disk`.
Everything streams: the reader holds one batch of about `batch_bytes` of raw records, never a
whole file. Parsing (JSON, UTF-8) happens in `record_text` and `record_fields`, which
preprocessing runs in its worker processes; a record that cannot be parsed raises `BadRecord`,
and the caller reports it with the file and line (or row). docs/data.md ("Preprocessing").
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from setdiff_megatron.errors import UserError, require

# Compressed names first and ".jsonl" before ".json", so "a.jsonl.gz" is JSONL named "a".
_SUFFIX_KINDS = tuple(
    (suffix + gz, kind)
    for gz in (".gz", "")
    for suffix, kind in ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "jsonl"), (".txt", "text"))
) + ((".parquet", "parquet"),)
_MAX_RECORDS_PER_BATCH = 8192


@dataclass(frozen=True, slots=True)
class Source:
    """One input corpus: where it is, its format, and the output name derived from it."""

    path: Path
    kind: str  # "jsonl" | "text" | "parquet" | "arrow"
    name: str

    def where(self, location: int) -> str:
        """A record's place for error messages: "file:line" for line formats, else "file row n"."""
        return f"{self.path}:{location}" if self.kind in ("jsonl", "text") else f"{self.path} row {location}"


@dataclass(slots=True)
class RecordBatch:
    """Raw records in input order: bytes (JSONL line, text paragraph) or {column: value} (Parquet,
    datasets)."""

    kind: str
    locations: list[int]  # 1-based line (JSONL/text: first line of the document) or row
    payloads: list[Any]
    done: float  # fraction of the input consumed after this batch, for the progress bar


class BadRecord(ValueError):
    """A record that is not a document (not JSON, no text field, not UTF-8, null)."""


def detect_source(path: str | Path) -> Source:
    """Classify an input path by its name (or, for a directory, its `datasets` files)."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise UserError(f"{path} is a DatasetDict; pass one split directory ({', '.join(splits)})")
        if not (path / "state.json").is_file():
            raise UserError(f"{path} is a directory but not a dataset saved with datasets' save_to_disk")
        return Source(path, "arrow", path.name)
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    lower = path.name.lower()
    for suffix, kind in _SUFFIX_KINDS:
        if lower.endswith(suffix) and len(lower) > len(suffix):
            return Source(path, kind, path.name[: -len(suffix)])
    raise UserError(
        f"unknown input type {path.name}: expected .jsonl/.json/.txt[.gz], .parquet or a datasets directory"
    )


def source_sha256(source: Source) -> str:
    """Checksum of the input's bytes (for a `datasets` directory: of all its files, by name)."""
    digest = hashlib.sha256()
    if source.kind == "arrow":
        files = sorted(p for p in source.path.rglob("*") if p.is_file())
    else:
        files = [source.path]
    for file in files:
        if source.kind == "arrow":
            digest.update(file.relative_to(source.path).as_posix().encode("utf-8") + b"\0")
        with open(file, "rb") as stream:
            while chunk := stream.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def read_batches(source: Source, *, fields: tuple[str, ...], text_unit: str, batch_bytes: int) -> Iterator[RecordBatch]:
    """Stream the raw records of `source` in order, in batches of about `batch_bytes`; columnar
    formats read only the `fields` columns (plain text has no fields)."""
    if source.kind == "jsonl":
        records = _jsonl_records(source.path)
    elif source.kind == "text":
        records = _text_records(source.path, text_unit)
    elif source.kind == "parquet":
        records = _parquet_records(source.path, fields)
    else:
        records = _arrow_records(source.path, fields)
    batch = RecordBatch(source.kind, [], [], 0.0)
    size = 0
    for location, payload, done in records:
        batch.locations.append(location)
        batch.payloads.append(payload)
        batch.done = done
        size += len(payload) if isinstance(payload, bytes) else _cell_bytes(payload)
        if size >= batch_bytes or len(batch.payloads) >= _MAX_RECORDS_PER_BATCH:
            yield batch
            batch, size = RecordBatch(source.kind, [], [], done), 0
    if batch.payloads:
        yield batch


def record_fields(kind: str, payload: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """The named fields of one raw JSONL or columnar record, or BadRecord saying why there are
    none (plain text records have no fields: see `record_text`). A pretraining document reads one
    field, its text; a supervised record several, its prompt and response or its chat messages."""
    if kind == "jsonl":
        try:
            obj = json.loads(payload)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise BadRecord(f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise BadRecord("not a JSON object")
    else:
        obj = payload
    missing = [f for f in fields if obj.get(f) is None]
    if missing:
        raise BadRecord(f"no {missing[0]!r} field" if kind == "jsonl" else f"{missing[0]!r} is null")
    return {f: obj[f] for f in fields}


def record_text(kind: str, payload: Any, text_field: str) -> str:
    """The document text of one raw record, or BadRecord saying why there is none."""
    if kind == "text":
        try:
            return payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRecord(f"not valid UTF-8 ({exc})") from None
    text = record_fields(kind, payload, (text_field,))[text_field]
    if not isinstance(text, str):
        raise BadRecord(f"field {text_field!r} is not a string")
    return text


def _open_lines(path: Path) -> tuple[Any, Any]:
    """Binary line stream plus the raw file, whose position measures progress through a .gz."""
    raw = open(path, "rb")
    return (gzip.open(raw, "rb") if path.suffix.lower() == ".gz" else raw), raw


def _jsonl_records(path: Path) -> Iterator[tuple[int, bytes, float]]:
    total = max(path.stat().st_size, 1)
    lines, raw = _open_lines(path)
    with raw, lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield number, line, raw.tell() / total


def _text_records(path: Path, text_unit: str) -> Iterator[tuple[int, bytes, float]]:
    total = max(path.stat().st_size, 1)
    lines, raw = _open_lines(path)
    paragraph: list[bytes] = []
    start = 0
    with raw, lines:
        for number, line in enumerate(lines, start=1):
            if text_unit == "line":
                if line.strip():
                    yield number, _strip_newline(line), raw.tell() / total
            elif line.strip():
                start = start or number
                paragraph.append(line)
            elif paragraph:
                yield start, _strip_newline(b"".join(paragraph)), raw.tell() / total
                paragraph, start = [], 0
        if paragraph:
            yield start, _strip_newline(b"".join(paragraph)), 1.0


def _strip_newline(text: bytes) -> bytes:
    if text.endswith(b"\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith(b"\n") else text


def _missing_column(path: Path, fields: tuple[str, ...], names: list[str]) -> None:
    for name in fields:
        if name not in names:
            raise UserError(f"{path} has no column {name!r} (columns: {', '.join(names)})")


def _parquet_records(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[int, dict[str, Any], float]]:
    pq = require("pyarrow.parquet", "data", "Reading Parquet input")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid and friends
        raise UserError(f"cannot read Parquet file {path}: {exc}") from exc
    _missing_column(path, fields, parquet.schema_arrow.names)
    total = max(parquet.metadata.num_rows, 1)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=list(fields)):
        for record in batch.to_pylist():
            row += 1
            yield row, record, row / total


def _arrow_records(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[int, dict[str, Any], float]]:
    datasets = require("datasets", "data", "Reading a saved datasets dataset")
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001 - datasets raises several unrelated types
        raise UserError(f"cannot load dataset {path}: {exc}") from exc
    _missing_column(path, fields, dataset.column_names)
    total = max(len(dataset), 1)
    row = 0
    for batch in dataset.select_columns(list(fields)).iter(batch_size=1024):
        for values in zip(*(batch[name] for name in fields)):
            row += 1
            yield row, dict(zip(fields, values)), row / total


def _cell_bytes(record: dict[str, Any]) -> int:
    """About how many bytes a columnar record holds, for batching (strings, and chat turns)."""
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v, default=str)) for v in record.values())
