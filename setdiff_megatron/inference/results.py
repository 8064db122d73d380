"""Per-example results of a sharded job, resumable, merged into one ordered JSONL file.

Each shard appends its records (one JSON object per line, keyed by "index") to its own file
under `<out>.parts/`, flushed and fsynced batch by batch, so an interrupted job loses at most
the batch in flight; a torn last line is cut off when the shard reopens its file. A rerun
skips every index already written, under any sharding. When every index is present, the parts
are merged in index order into `<out>` (written to a temporary name, then renamed) and removed.
`<out>.job.json` records what produced the results (model, prompts, settings); a rerun with
other settings is refused rather than mixed in. A job may name how to read a part of its record
(`same_as`: the decoding settings that differ from their defaults), so that a setting added in a
later version, at its default, does not set a saved job apart.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from setdiff_megatron.errors import UserError

__all__ = ["ShardedResults"]


def _complete_records(path: Path) -> Iterable[dict[str, Any]]:
    """The records of a JSONL file, a torn (unterminated or unparsable) last line excepted."""
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                return


class ShardedResults:
    def __init__(self, out: str | Path, job: dict[str, Any], same_as: Mapping[str, Callable[[Any], Any]] | None = None):
        self.out = Path(out)
        self.parts = self.out.with_name(self.out.name + ".parts")
        self.job_file = self.out.with_name(self.out.name + ".job.json")
        self.job = json.loads(json.dumps(job))  # as it reads back from disk
        self.same_as = dict(same_as or {})
        """For a key of the record, what of its value tells two jobs apart."""

    def _compared(self, key: str, value: Any) -> Any:
        return self.same_as[key](value) if key in self.same_as and value is not None else value

    def check_job(self) -> None:
        """Refuse to mix results of other settings into existing ones (read-only: every rank may call it)."""
        if not (self.out.exists() or self.parts.exists()):
            return
        if not self.job_file.is_file():
            raise UserError(
                f"{self.out} exists and was not written by this kind of job (no {self.job_file.name}); "
                "choose another output path"
            )
        saved = json.loads(self.job_file.read_text())
        diffs = [
            f"{k}: {self._compared(k, saved.get(k))!r} there, {self._compared(k, v)!r} here"
            for k, v in self.job.items()
            if self._compared(k, saved.get(k)) != self._compared(k, v)
        ]
        if diffs:
            raise UserError(
                f"{self.out} holds results of other settings ({'; '.join(diffs)}); "
                "choose another output path or delete it"
            )

    def start(self) -> None:
        """Write the job record, then create the parts folder (one process). In that order: the
        other processes' `check_job` may run meanwhile, and must find nothing yet or this job's
        record, never a parts folder without one (which it refuses as another job's)."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if not self.job_file.is_file():
            tmp = self.job_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.job, indent=1))
            tmp.replace(self.job_file)
        self.parts.mkdir(exist_ok=True)

    def done(self) -> set[int]:
        files = [self.out, *sorted(self.parts.glob("*.jsonl"))] if self.parts.is_dir() else [self.out]
        return {r["index"] for path in files for r in _complete_records(path)}

    def part(self, name: str) -> _PartWriter:
        return _PartWriter(self.parts / f"{name}.jsonl")

    def merge(self, total: int) -> list[int]:
        """Write `<out>` if indices 0..total-1 are all present; return the missing ones otherwise."""
        records: dict[int, dict] = {}
        for path in [self.out, *sorted(self.parts.glob("*.jsonl"))]:
            for record in _complete_records(path):
                records.setdefault(record["index"], record)
        missing = [i for i in range(total) if i not in records]
        if missing:
            return missing
        tmp = self.out.with_name(self.out.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for i in range(total):
                f.write(json.dumps(records[i], ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.out)
        shutil.rmtree(self.parts, ignore_errors=True)
        return []


class _PartWriter:
    """Appends whole lines to one shard's file; opening cuts a torn last line left by a crash."""

    def __init__(self, path: Path):
        self.path = path
        if path.is_file():
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep != len(data):
                with path.open("r+b") as f:
                    f.truncate(keep)

    def write(self, records: list[dict[str, Any]]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
