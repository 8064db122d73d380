"""The manifest of a checkpoint: size and sha256 of every file, written last, checked first.

A checkpoint is complete when its manifest exists and every file it lists has its size and hash.
Both hashing and checking can be shared by the ranks of a job (`collective`): each takes a slice
of the files, and rank 0's listing is the truth for everyone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist

from setdiff_megatron.checkpoint.names import MANIFEST
from setdiff_megatron.distributed.runtime import broadcast_object, gather_objects

__all__ = ["write_manifest", "verify", "sha256_file"]


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _shared(collective: bool) -> bool:
    return collective and dist.is_initialized()


def _share(items: list, collective: bool) -> list:
    return items[dist.get_rank() :: dist.get_world_size()] if _shared(collective) else items


def write_manifest(directory: Path, *, collective: bool = True) -> None:
    """Hash every file of `directory` (a share per rank when `collective`); rank 0 writes it."""
    names = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    if _shared(collective):
        names = broadcast_object(names)
    mine = {
        rel: {"size": (directory / rel).stat().st_size, "sha256": sha256_file(directory / rel)}
        for rel in _share(names, collective)
    }
    parts = gather_objects(mine) if _shared(collective) else [mine]
    if not _shared(collective) or dist.get_rank() == 0:
        files = dict(sorted(kv for part in parts for kv in part.items()))
        (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _file_problem(directory: Path, rel: str, entry: dict, checksums: bool) -> str | None:
    path = directory / rel
    if not path.is_file():
        return f"{path} is missing"
    if path.stat().st_size != entry["size"]:
        return f"{path} has {path.stat().st_size} bytes, the manifest says {entry['size']} (truncated?)"
    if checksums and sha256_file(path) != entry["sha256"]:
        return f"{path} does not match its sha256 in the manifest (damaged or modified)"
    return None


def verify(directory: Path, *, checksums: bool = True, collective: bool = False) -> str | None:
    """Why `directory` is not a complete checkpoint (naming the file), or None if it is. With
    `collective`, every rank of the job calls it and checks a share of the files."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} is not a directory"
    try:
        entries = sorted(json.loads((directory / MANIFEST).read_text())["files"].items())
        if not all(isinstance(e, dict) and {"size", "sha256"} <= e.keys() for _, e in entries):
            raise ValueError
    except FileNotFoundError:
        return f"{directory / MANIFEST} is missing (an interrupted save?)"
    except (ValueError, KeyError, AttributeError, TypeError):
        return f"{directory / MANIFEST} is unreadable"
    indexed = list(enumerate(entries))
    found = [
        (i, p)
        for i, (rel, entry) in _share(indexed, collective)
        if (p := _file_problem(directory, rel, entry, checksums))
    ]
    problems = sorted(x for part in (gather_objects(found) if _shared(collective) else [found]) for x in part)
    return problems[0][1] if problems else None
