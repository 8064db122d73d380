"""Reading JSONL input files line by line, with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from setdiff_megatron.errors import UserError

__all__ = ["jsonl_records"]


def jsonl_records(path: str | Path, what: str) -> Iterator[tuple[int, str, Any]]:
    """(1-based line number, "path:line", parsed value) of every non-blank line of `path`.
    `what` names the file in the error for a missing one ("prompt file", "task file")."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield number, where, json.loads(text)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
