"""Supervised records: a prompt kept as clean context, a response (plus EOS) as the target.

`encode_record` encodes a record's prompt/response fields, or its chat `messages` split at the
last assistant turn (data/chat.py); preprocessing stores each record as two sequences, prompt and
response. `RowFormat` turns a stored record into a row's tokens when samples are built
(data/packing.py), and formats evaluation prompts the same way (docs/data.md, "Rows").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from setdiff_megatron.data.chat import ChatError, render_chat, split_conversation
from setdiff_megatron.data.sources import BadRecord
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError

__all__ = ["RecordFields", "RowFormat", "encode_record", "check_chat_template"]


@dataclass(frozen=True, slots=True)
class RecordFields:
    """Which fields of an input record make a prompt/response pair."""

    prompt: str = "prompt"
    response: str = "response"
    messages: str | None = None
    """A chat conversation field; when set, `prompt` and `response` are not read."""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.messages,) if self.messages else (self.prompt, self.response)

    def recorded(self) -> dict[str, Any]:
        return {"supervised": asdict(self)}


def check_chat_template(fields: RecordFields, tokenizer: SetDiffTokenizer, where: str) -> None:
    if fields.messages and tokenizer.chat_template is None:
        raise UserError(
            f"{where} has no chat template (tokenizer_config.json 'chat_template') to render "
            f"'{fields.messages}' with; use a tokenizer that has one, or prompt/response fields"
        )


def encode_record(
    record: dict[str, Any], fields: RecordFields, tokenizer: SetDiffTokenizer
) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids ending with EOS) of one parsed record, or BadRecord."""
    if fields.messages:
        try:
            context, response = split_conversation(tokenizer.chat_template, record[fields.messages])
        except ChatError as exc:
            raise BadRecord(str(exc)) from None
        prompt_ids, response_ids = tokenizer.encode_markup(context), tokenizer.encode_markup(response)
    else:
        for name in fields.names:
            if not isinstance(record[name], str):
                raise BadRecord(f"field {name!r} is not a string")
        if not record[fields.response]:
            raise BadRecord(f"the response ({fields.response!r}) is empty")
        prompt_ids, response_ids = tokenizer.encode(record[fields.prompt]), tokenizer.encode(record[fields.response])
    if not response_ids:
        raise BadRecord("the response is empty")
    if response_ids[-1] != tokenizer.eos_id:
        response_ids = response_ids + [tokenizer.eos_id]
    return prompt_ids, response_ids


@dataclass(frozen=True, slots=True)
class RowFormat:
    """How a stored record becomes the tokens of a training row (and a prompt for evaluation)."""

    bos_id: int | None = None
    """Begin every prompt with this id (recipes: method.keep_clean_bos)."""
    prompt_eos_id: int | None = None
    """End every prompt with this id (data.supervised.prompt_eos: the reference's CNN/DM source)."""
    max_prompt_tokens: int | None = None
    """Keep the first tokens of a longer prompt (BOS and EOS included in the count)."""
    max_response_tokens: int | None = None
    """Keep the first tokens of a longer response (its EOS included in the count)."""
    force_eos: bool = False
    """A cut response still ends with EOS, its last kept token replaced."""

    @property
    def _extra(self) -> int:
        return int(self.bos_id is not None) + int(self.prompt_eos_id is not None)

    def prompt_lengths(self, stored: np.ndarray) -> np.ndarray:
        """Row prompt lengths of stored prompt lengths (vectorised over records)."""
        lengths = stored.astype(np.int64) + self._extra
        return lengths if self.max_prompt_tokens is None else np.minimum(lengths, self.max_prompt_tokens)

    def response_lengths(self, stored: np.ndarray, room: np.ndarray) -> np.ndarray:
        lengths = stored.astype(np.int64)
        if self.max_response_tokens is not None:
            lengths = np.minimum(lengths, self.max_response_tokens)
        return np.minimum(lengths, room)

    def prompt(self, ids: np.ndarray | list[int]) -> np.ndarray:
        """The row's prompt tokens of stored (or evaluation) prompt ids."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.max_prompt_tokens is not None:
            ids = ids[: max(self.max_prompt_tokens - self._extra, 0)]
        head = [self.bos_id] if self.bos_id is not None else []
        tail = [self.prompt_eos_id] if self.prompt_eos_id is not None else []
        return np.concatenate([np.array(head, dtype=np.int64), ids, np.array(tail, dtype=np.int64)])

    def response(self, ids: np.ndarray, length: int, eos_id: int) -> np.ndarray:
        """The first `length` response tokens; EOS last when forced and cut."""
        kept = np.array(ids[:length], dtype=np.int64)
        if self.force_eos and length < len(ids) and length > 0:
            kept[-1] = eos_id
        return kept


def chat_prompt(
    template: str, messages: list[dict[str, str]], tokenizer: SetDiffTokenizer, fmt: RowFormat
) -> list[int]:
    """A conversation so far as a prompt: the chat template with its generation prompt, markup as
    special tokens, formatted as training rows began (the context of a supervised chat record).
    Raises ChatError."""
    text = render_chat(template, messages, add_generation_prompt=True)
    return fmt.prompt(tokenizer.encode_markup(text)).tolist()
