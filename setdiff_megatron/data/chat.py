"""Chat conversations as text, through the tokenizer's own Jinja chat template.

One renderer serves supervised preprocessing, which splits a conversation at its last assistant
turn (`split_conversation`), and `setdiff eval generate` and `setdiff serve`, which render the
conversation so far with the generation prompt: the same context, so a model is prompted the way
it was trained (docs/data.md, "Preprocessing"). Templates run in jinja2's immutable sandbox.
"""

from __future__ import annotations

import functools
from typing import Any

from setdiff_megatron.errors import require

__all__ = ["ChatError", "check_messages", "render_chat", "split_conversation"]


class ChatError(ValueError):
    """A conversation that cannot be rendered or split, with the reason."""


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The conversation as a list of {"role", "content"} strings, or ChatError saying why not."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of {role, content} turns")
    turns = []
    for i, turn in enumerate(messages):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise ChatError(f"turn {i} of 'messages' needs a string 'role' and a string 'content'")
        turns.append({"role": turn["role"], "content": turn["content"]})
    return turns


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    """A template compiled once per process: preprocessing renders one per record, serving one per
    request."""
    from jinja2 import sandbox

    # The immutable sandbox: a tokenizer directory is data, not code.
    return sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


def render_chat(template: str, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """The conversation as the template writes it. BOS and EOS render as empty strings: the
    recipe's `method.keep_clean_bos` and the EOS after every response are added as ids, never as
    text."""
    jinja2 = require("jinja2", "data", "Chat templates")
    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token=""
        )
    except jinja2.TemplateError as exc:
        raise ChatError(f"the chat template failed on this conversation: {exc}") from None


def split_conversation(template: str, messages: Any) -> tuple[str, str]:
    """(context, response) texts of a conversation that ends with the assistant's turn: the
    context is everything the template writes before that turn's content, the response is the
    content and whatever the template closes the turn with."""
    turns = check_messages(messages)
    last = turns[-1]
    if last["role"] != "assistant":
        raise ChatError(f"the last turn of 'messages' must be the assistant's response, not {last['role']!r}")
    if not last["content"]:
        raise ChatError("the assistant's response is empty")
    text = render_chat(template, turns, add_generation_prompt=False)
    start = text.rfind(last["content"])
    if start < 0:
        raise ChatError(
            "the chat template does not write the assistant's response verbatim, so the context cannot be split from it"
        )
    return text[:start], text[start:]
