"""The built-in code corpus: the Python standard library's own source files, on every machine.

Each non-test `.py` file of the stdlib is one document, in sorted path order; every
`HOLDOUT_EVERY`-th is held out for validation, and `DEFAULT_MAX_BYTES` caps the source by
keeping an evenly spaced subset. `prepare_default_corpus` writes them as JSONL, trains a
byte-level BPE on the training files and preprocesses both splits; a rerun reuses what is done.
The corpus differs between Python versions (docs/data.md, "The built-in code corpus").
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from setdiff_megatron.data.preprocess import TOKENIZER_SUBDIR, PreprocessOptions, preprocess
from setdiff_megatron.data.sources import detect_source, source_sha256
from setdiff_megatron.data.tokenizers import (
    SETDIFF_FILE,
    SetDiffTokenizer,
    load_tokenizer,
    train_byte_level_bpe,
)
from setdiff_megatron.errors import UserError

DEFAULT_MAX_BYTES = 8_000_000
HOLDOUT_EVERY = 20
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_RECORD_FILE = "corpus.json"


@dataclass(frozen=True, slots=True)
class DefaultCorpus:
    """Where `prepare_default_corpus` put things; the prefixes are what the sample builder takes."""

    directory: Path
    tokenizer_dir: Path
    train_prefix: Path
    valid_prefix: Path


def stdlib_documents(max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[tuple[str, str]]:
    """(relative path, source text) of the stdlib's non-test .py files, sorted by path.

    With `max_bytes`, an evenly spaced subset of about `max_bytes` (not the first files
    alphabetically, which would be mostly asyncio, email and codec tables). Excluded directories
    are pruned from the walk: site-packages alone can hold far more files than the stdlib.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        files += [Path(directory, n) for n in names if n.endswith(".py") and not n.startswith("test_")]
    files.sort(key=lambda path: path.relative_to(root).parts)
    if not files:
        raise UserError(f"no Python source files found under {root}")
    sizes = [path.stat().st_size for path in files]
    if max_bytes is not None and sum(sizes) > max_bytes:
        ratio = max_bytes / sum(sizes)
        files = [path for i, path in enumerate(files) if int((i + 1) * ratio) > int(i * ratio)]
    documents = []
    for path in files:
        try:
            documents.append((path.relative_to(root).as_posix(), path.read_bytes().decode("utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return documents


def is_heldout(index: int, holdout_every: int = HOLDOUT_EVERY) -> bool:
    """Whether the index-th document of `stdlib_documents` is held out for validation."""
    return index % holdout_every == holdout_every - 1


def write_stdlib_corpus(
    directory: str | Path,
    *,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    holdout_every: int = HOLDOUT_EVERY,
) -> tuple[Path, Path]:
    """Write train.jsonl and valid.jsonl ({"text", "path"} per line); every `holdout_every`-th
    document goes to valid. Returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    documents = stdlib_documents(max_bytes)
    splits = {"train": [], "valid": []}
    for i, (path, text) in enumerate(documents):
        splits["valid" if is_heldout(i, holdout_every) else "train"].append((path, text))
    if not splits["valid"]:
        raise UserError(f"max_bytes={max_bytes} keeps under {holdout_every} files: nothing to hold out")
    written = []
    for split, records in splits.items():
        target = directory / f"{split}.jsonl"
        partial = target.with_name(target.name + ".partial")
        with open(partial, "w", encoding="utf-8") as stream:
            for path, text in records:
                stream.write(json.dumps({"text": text, "path": path}, ensure_ascii=False) + "\n")
        os.replace(partial, target)
        written.append(target)
    return written[0], written[1]


def prepare_default_corpus(
    out_dir: str | Path,
    vocab_size: int = 4096,
    *,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    workers: int = 2,
    progress: bool = True,
) -> DefaultCorpus:
    """Write the stdlib corpus, train (or reuse) a byte-level BPE, and preprocess train/valid.

    A rerun with the same arguments on the same Python reuses the tokenizer and skips both
    datasets, so calling this at the start of every job is cheap. Two workers suffice: the
    corpus is small and each spawned worker costs a second to start.
    """
    out_dir = Path(out_dir)
    train_jsonl, valid_jsonl = write_stdlib_corpus(out_dir / "raw", max_bytes=max_bytes)
    tokenizer_dir = out_dir / TOKENIZER_SUBDIR
    tokenizer = _corpus_tokenizer(out_dir, tokenizer_dir, train_jsonl, vocab_size)
    options = PreprocessOptions(workers=workers, progress=progress)
    preprocess([train_jsonl, valid_jsonl], out_dir, tokenizer, options)
    return DefaultCorpus(out_dir, tokenizer_dir, out_dir / "train", out_dir / "valid")


def _corpus_tokenizer(out_dir: Path, tokenizer_dir: Path, train_jsonl: Path, vocab_size: int) -> SetDiffTokenizer:
    """Reuse the saved tokenizer if it was trained on this very corpus with this vocab size."""
    record = {
        "python": sys.version.split()[0],
        "vocab_size": vocab_size,
        "train_sha256": source_sha256(detect_source(train_jsonl)),
    }
    record_path = out_dir / _RECORD_FILE
    if (tokenizer_dir / SETDIFF_FILE).is_file() and record_path.is_file():
        if json.loads(record_path.read_text(encoding="utf-8")) == record:
            return load_tokenizer(tokenizer_dir)
    with open(train_jsonl, encoding="utf-8") as stream:
        tokenizer = train_byte_level_bpe((json.loads(line)["text"] for line in stream), vocab_size)
    tokenizer.save(tokenizer_dir)
    record_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return tokenizer
