"""Prompt files: one JSON object per line, read with line-numbered errors.

A line holds exactly one of `"prompt": "text"`; `"messages": [{"role": ..., "content": ...}, ...]`,
a chat rendered with the model's own chat template; or `"segments": ["text", 12, "more text"]`,
where an integer n is a span of n masked tokens to infill. Other keys (an `id`, references) travel
to the output untouched; blank lines are skipped. Prompts are encoded as the model's training rows
began (`encode_prompt`; docs/sampling.md, "Jobs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from setdiff_megatron.data.chat import ChatError, check_messages
from setdiff_megatron.data.supervised import RowFormat, chat_prompt
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.jsonl import jsonl_records

__all__ = ["PromptRecord", "read_prompts", "encode_prompt", "infill_prompt"]


@dataclass(frozen=True)
class PromptRecord:
    index: int
    """Rank among the file's non-blank lines: the key by which outputs are merged and resumed."""
    line: int
    """1-based line number in the file, for error messages."""
    segments: tuple[str | int, ...]
    extra: dict[str, Any]
    """The record's other keys, copied to the output."""
    messages: tuple[dict[str, str], ...] | None = None
    """A chat prompt (then `segments` is empty)."""


KINDS = ("prompt", "messages", "segments")


def _segments(record: Any, where: str) -> tuple[str | int, ...]:
    if not isinstance(record, dict):
        raise UserError(
            f"{where}: expected a JSON object with 'prompt', 'messages' or 'segments'; got {type(record).__name__}"
        )
    if sum(kind in record for kind in KINDS) != 1:
        raise UserError(
            f"{where}: give exactly one of 'prompt' (text), 'messages' (a chat) or 'segments' (texts and span lengths)"
        )
    if "messages" in record:
        return ()
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            raise UserError(f"{where}: 'prompt' must be a string")
        return (record["prompt"],)
    segments = record["segments"]
    ok = isinstance(segments, list) and all(
        isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool) and s >= 1) for s in segments
    )
    if not ok or not segments:
        raise UserError(f"{where}: 'segments' must be a non-empty list of strings and span lengths >= 1")
    return tuple(segments)


def read_prompts(path: str | Path) -> list[PromptRecord]:
    records = []
    for number, where, record in jsonl_records(path, "prompt file"):
        segments = _segments(record, where)
        messages = None
        if "messages" in record:
            try:
                messages = tuple(check_messages(record["messages"]))
            except ChatError as exc:
                raise UserError(f"{where}: {exc}") from None
        extra = {k: v for k, v in record.items() if k not in KINDS}
        records.append(PromptRecord(index=len(records), line=number, segments=segments, extra=extra, messages=messages))
    if not records:
        raise UserError(
            f"prompt file {path} holds no prompts (one JSON object per line: "
            '{"prompt": "..."}, {"messages": [...]} or {"segments": ["...", 8, "..."]})'
        )
    return records


def encode_prompt(record: PromptRecord, tokenizer: SetDiffTokenizer, fmt: RowFormat) -> list[int]:
    """Token ids as the model's training rows began, with MASK tokens where spans are to be
    infilled (an infilling prompt is its segments after the BOS, never cut)."""
    if record.messages is not None:
        if tokenizer.chat_template is None:
            raise UserError(
                f"line {record.line}: a 'messages' prompt needs the model's chat template, and its "
                "tokenizer has none; give a 'prompt' instead"
            )
        try:
            return chat_prompt(tokenizer.chat_template, list(record.messages), tokenizer, fmt)
        except ChatError as exc:
            raise UserError(f"line {record.line}: {exc}") from None
    if len(record.segments) == 1 and isinstance(record.segments[0], str):
        return fmt.prompt(tokenizer.encode(record.segments[0])).tolist()
    return infill_prompt(record.segments, tokenizer, fmt)


def infill_prompt(segments: Sequence[str | int], tokenizer: SetDiffTokenizer, fmt: RowFormat) -> list[int]:
    """The BOS, then each text segment's tokens or a span of n MASK tokens for an integer n."""
    ids = [fmt.bos_id] if fmt.bos_id is not None else []
    for segment in segments:
        ids += tokenizer.encode(segment) if isinstance(segment, str) else [tokenizer.mask_id] * segment
    return ids
