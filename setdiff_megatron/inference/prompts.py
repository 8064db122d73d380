"""Prompt files: one JSON object per line, read with line-numbered errors.

A line holds either `"prompt": "text"` (continued by the sampler's generated tail) or
`"segments": ["text", 12, "more text"]`, where an integer n is a span of n masked tokens to
infill between the visible pieces. Other keys (an `id`, references, metadata) travel through to
the output untouched. Blank lines are skipped; the index of a prompt is its rank among the
non-blank lines, the key by which outputs are merged and resumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.jsonl import jsonl_records

__all__ = ["PromptRecord", "read_prompts", "encode_prompt"]


@dataclass(frozen=True)
class PromptRecord:
    index: int
    line: int
    """1-based line number in the file, for error messages."""
    segments: tuple[str | int, ...]
    extra: dict[str, Any]
    """The record's other keys, copied to the output."""


def _segments(record: Any, where: str) -> tuple[str | int, ...]:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with 'prompt' or 'segments'; got {type(record).__name__}")
    if ("prompt" in record) == ("segments" in record):
        raise UserError(f"{where}: give exactly one of 'prompt' (text) or 'segments' (texts and span lengths)")
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise UserError(f"{where}: 'prompt' must be a string")
        return (record["prompt"],)
    segments = record["segments"]
    ok = isinstance(segments, list) and all(
        isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool) and s >= 1) for s in segments)
    if not ok or not segments:
        raise UserError(f"{where}: 'segments' must be a non-empty list of strings and span lengths >= 1")
    return tuple(segments)


def read_prompts(path: str | Path) -> list[PromptRecord]:
    records = []
    for number, where, record in jsonl_records(path, "prompt file"):
        segments = _segments(record, where)
        extra = {k: v for k, v in record.items() if k not in ("prompt", "segments")}
        records.append(PromptRecord(index=len(records), line=number, segments=segments, extra=extra))
    if not records:
        raise UserError(f"prompt file {path} holds no prompts (one JSON object per line: "
                        '{"prompt": "..."} or {"segments": ["...", 8, "..."]})')
    return records


def encode_prompt(record: PromptRecord, tokenizer: SetDiffTokenizer, *, add_bos: bool) -> list[int]:
    """Token ids with MASK tokens where spans are to be infilled."""
    ids = [tokenizer.bos_id] if add_bos else []
    for segment in record.segments:
        ids += tokenizer.encode(segment) if isinstance(segment, str) else [tokenizer.mask_id] * segment
    return ids
