"""The response objects of `setdiff serve`, built from the `openai` package's own types.

They are serialised as the openai client's `to_dict` writes them, with only the fields the server
set: a response has the keys OpenAI's API sends (a choice's `logprobs: null`, a chunk's
`finish_reason: null`) and none of the optional ones this server has no value for
(system_fingerprint, service_tier, ...). Where openai has no type (a streamed completion's
choice, the model list), a subclass or a small pydantic model of this module stands in.
"""

import time
from abc import ABC, abstractmethod
from typing import ClassVar, Literal, NamedTuple

from pydantic import BaseModel

from setdiff_megatron.errors import require

require("openai", "serve", "setdiff serve")

from openai.types import Completion, CompletionChoice, CompletionUsage, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage  # noqa: E402
from openai.types.chat.chat_completion import Choice as ChatChoice  # noqa: E402
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice  # noqa: E402
from openai.types.chat.chat_completion_chunk import ChoiceDelta  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402

__all__ = ["ChatResponses", "ChoiceText", "CompletionResponses", "Responses", "Usage", "error_json", "model_list"]

FinishReason = Literal["stop", "length"]


class Usage(CompletionUsage):
    """OpenAI's token counts plus what a set diffusion answer cost: network evaluations, and the
    tokens each step decided."""

    nfe: int
    tokens_per_step: float


class StreamedCompletionChoice(CompletionChoice):
    """A completion chunk's choice: OpenAI's streams reuse CompletionChoice, whose finish_reason
    is null until the choice's last chunk."""

    finish_reason: FinishReason | None


class ModelList(BaseModel):
    """GET /v1/models: the openai package lists models as a client-side page, not a type."""

    object: Literal["list"]
    data: list[Model]


class ChoiceText(NamedTuple):
    """A choice's text (whole, or a streamed delta) and why it ended, None while it goes on."""

    index: int
    text: str
    finish_reason: FinishReason | None


class Responses(ABC):
    """The response objects of one request, each with its id, creation time and model."""

    id_prefix: ClassVar[str]

    def __init__(self, request_id: str, model: str) -> None:
        self.id, self.created, self.model = self.id_prefix + request_id, int(time.time()), model

    @abstractmethod
    def response(self, choices: list[ChoiceText], usage: Usage) -> dict:
        """The whole answer of a request that does not stream."""

    def opening_chunks(self, indices: list[int]) -> list[dict]:
        """What a stream sends before the first text."""
        return []

    @abstractmethod
    def chunk(self, choice: ChoiceText) -> dict:
        """One streamed delta of one choice."""

    def usage_chunk(self, usage: Usage) -> dict:
        """A stream's last chunk where the client asked for usage: no choices."""
        return self._chunk_of([], usage=usage)

    @abstractmethod
    def _chunk_of(self, choices: list, **usage: Usage) -> dict:
        """A stream chunk around `choices`; its usage key only where given."""

    def _stamp(self) -> dict:
        """The fields every object of the request repeats (its `object` names the type)."""
        return {"id": self.id, "created": self.created, "model": self.model}


class CompletionResponses(Responses):
    """/v1/completions: a completion and its stream chunks share one shape (unlike chat's)."""

    id_prefix = "cmpl-"

    def response(self, choices: list[ChoiceText], usage: Usage) -> dict:
        return self._chunk_of([CompletionChoice(**c._asdict(), logprobs=None) for c in choices], usage=usage)

    def chunk(self, choice: ChoiceText) -> dict:
        return self._chunk_of([StreamedCompletionChoice(**choice._asdict(), logprobs=None)])

    def _chunk_of(self, choices: list, **usage: Usage) -> dict:
        return _json(Completion(**self._stamp(), object="text_completion", choices=choices, **usage))


class ChatResponses(Responses):
    """/v1/chat/completions: the assistant's message, or its deltas after one that names its role."""

    id_prefix = "chatcmpl-"

    def response(self, choices: list[ChoiceText], usage: Usage) -> dict:
        return _json(
            ChatCompletion(
                **self._stamp(),
                object="chat.completion",
                usage=usage,
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=ChatCompletionMessage(role="assistant", content=c.text),
                        finish_reason=c.finish_reason,
                        logprobs=None,
                    )
                    for c in choices
                ],
            )
        )

    def opening_chunks(self, indices: list[int]) -> list[dict]:
        return [
            self._chunk_of([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""), finish_reason=None)])
            for i in indices
        ]

    def chunk(self, choice: ChoiceText) -> dict:
        delta = ChoiceDelta(content=choice.text) if choice.text else ChoiceDelta()
        return self._chunk_of(
            [ChunkChoice(index=choice.index, delta=delta, finish_reason=choice.finish_reason, logprobs=None)]
        )

    def _chunk_of(self, choices: list, **usage: Usage) -> dict:
        return _json(ChatCompletionChunk(**self._stamp(), object="chat.completion.chunk", choices=choices, **usage))


def model_list(name: str) -> dict:
    """The one model this server serves."""
    return _json(ModelList(object="list", data=[Model(id=name, object="model", created=0, owned_by="setdiff")]))


def error_json(
    message: str, *, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"
) -> dict:
    """OpenAI's error object, as its API answers a bad request."""
    return {"error": _json(ErrorObject(message=message, type=kind, param=param, code=code))}


def _json(response: BaseModel) -> dict:
    """Only the fields set (see the module's docstring), a subclass's own ones included (usage's nfe)."""
    return response.model_dump(exclude_unset=True, serialize_as_any=True)
