"""Preprocessed datasets on disk: megatron-core's `.bin/.idx` pair plus our manifest.

A dataset with prefix P is `P.bin` and `P.idx` (one sequence per document, two for a supervised
record: prompt and response), `P.manifest.json` and, for supervised data, `P.locations.npy`.
The manifest is written last (`IndexedWriter`): without one a dataset is unfinished, and
`open_indexed` refuses it. megatron-core is imported lazily (`megatron_datasets`), so the
tokenizer and the input readers work without it (docs/data.md, "Preprocessing").
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from setdiff_megatron.errors import UserError, require

MANIFEST_SUFFIX = ".manifest.json"
LOCATIONS_SUFFIX = ".locations.npy"
PARTIAL_SUFFIX = ".partial"
MANIFEST_FORMAT = "setdiff-indexed-v1"


def megatron_datasets(module: str) -> ModuleType:
    """Import `megatron.core.datasets.<module>`, without the TE/Apex fallback warnings.

    Importing megatron.core warns that Transformer Engine and Apex are missing; for dataset code
    that is noise (it needs neither), so it is silenced here and only here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        return require(f"megatron.core.datasets.{module}", "megatron", "Indexed datasets and samples")


def bin_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".bin")


def idx_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".idx")


def manifest_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + MANIFEST_SUFFIX)


def locations_path(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + LOCATIONS_SUFFIX)


def dataset_kind(manifest: dict[str, Any]) -> str:
    """'pretraining' (documents) or 'supervised' (prompt/response records)."""
    return manifest.get("kind", "pretraining")


def read_manifest(prefix: Path) -> dict[str, Any] | None:
    """The manifest of a finished dataset whose files are all present, else None."""
    path = manifest_path(prefix)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if manifest.get("format") != MANIFEST_FORMAT or not idx_path(prefix).is_file():
        return None
    if not bin_path(prefix).is_file() or bin_path(prefix).stat().st_size != manifest.get("bin_bytes"):
        return None
    if dataset_kind(manifest) == "supervised" and not locations_path(prefix).is_file():
        return None
    return manifest


def ensure_writable_dir(directory: Path) -> None:
    """Create `directory` and prove a file can be written there, or raise a one-line UserError."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UserError(f"cannot write to output directory {directory}: {exc.strerror or exc}") from exc


class IndexedWriter:
    """Writes one indexed dataset under temporary names; `commit` makes it finished.

    It deletes any old manifest before it starts, writes `P.bin.partial`/`P.idx.partial`, renames
    the pair into place when complete and only then writes the manifest. An interrupted run
    therefore leaves either `.partial` files or a pair without a manifest, and both preprocessing
    reruns and `open_indexed` treat those as unfinished. Use as a context manager: leaving the
    block without `commit` (an error, Ctrl-C) removes the partial files.
    """

    def __init__(self, prefix: Path, vocab_size: int, *, keep_locations: bool = False):
        indexed_dataset = megatron_datasets("indexed_dataset")
        self.prefix = prefix
        self._locations: list[int] | None = [] if keep_locations else None
        self.dtype = indexed_dataset.DType.optimal_dtype(vocab_size)
        self._partial_bin = bin_path(prefix).with_name(bin_path(prefix).name + PARTIAL_SUFFIX)
        self._partial_idx = idx_path(prefix).with_name(idx_path(prefix).name + PARTIAL_SUFFIX)
        # From here on any older files with this prefix no longer count as finished.
        manifest_path(prefix).unlink(missing_ok=True)
        self._builder = indexed_dataset.IndexedDatasetBuilder(str(self._partial_bin), dtype=self.dtype)
        self._committed = False

    def add_document(
        self, ids: np.ndarray, sequence_lengths: list[int] | None = None, *, location: int | None = None
    ) -> None:
        """Append one document (its tokens, EOS included): one sequence, or the given lengths
        (a supervised record's prompt and response), and its input location when kept."""
        self._builder.add_document(ids, [len(ids)] if sequence_lengths is None else sequence_lengths)
        if self._locations is not None:
            self._locations.append(location)

    def commit(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Finish the .bin/.idx (and locations), move them into place, then write the manifest (last)."""
        self._builder.finalize(str(self._partial_idx))
        if self._locations is not None:
            partial = locations_path(self.prefix).with_name(locations_path(self.prefix).name + PARTIAL_SUFFIX)
            with open(partial, "wb") as stream:
                np.save(stream, np.array(self._locations, dtype=np.int64))
            os.replace(partial, locations_path(self.prefix))
        os.replace(self._partial_bin, bin_path(self.prefix))
        os.replace(self._partial_idx, idx_path(self.prefix))
        manifest = {
            "format": MANIFEST_FORMAT,
            **manifest,
            "dtype": np.dtype(self.dtype).name,
            "bin_bytes": bin_path(self.prefix).stat().st_size,
        }
        final = manifest_path(self.prefix)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        partial.write_text(json.dumps(manifest, indent=2, ensure_ascii=True) + "\n", encoding="utf-8")
        os.replace(partial, final)
        self._committed = True
        return manifest

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._committed:
            self._builder.data_file.close()
            self._partial_bin.unlink(missing_ok=True)
            self._partial_idx.unlink(missing_ok=True)


def open_indexed(prefix: str | Path) -> Any:
    """Open a finished dataset as megatron-core's `IndexedDataset`; unfinished ones are refused."""
    prefix = Path(prefix)
    if read_manifest(prefix) is None:
        raise UserError(
            f"{prefix} is not a finished preprocessed dataset (no valid {manifest_path(prefix).name}); "
            "run setdiff preprocess"
        )
    return megatron_datasets("indexed_dataset").IndexedDataset(str(prefix))
