"""The OpenAI request bodies `setdiff serve` takes, checked, and what they mean for the sampler.

`/v1/completions` and `/v1/chat/completions` take OpenAI's fields (model, prompt or messages,
max_tokens, temperature, top_p, n, stream, stop, seed, suffix, user, stream_options) plus set
diffusion's own knobs as extra body fields (the `openai` client's `extra_body`): every decoding
setting OpenAI has no field for (sampling/decoding.py SETTINGS: window, threshold, tokens_per_step,
fill_window, block_size, top_k, repetition_penalty), each over the served model's own policy
(null turns an optional one off), and `segments` (text and span lengths to infill, instead of
`prompt`). OpenAI fields this server cannot honour
(logprobs, echo, best_of > 1, logit_bias, presence/frequency penalties) are refused, and any
other field is an error, as OpenAI's own API answers: HTTP 400 with an error object.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from setdiff_megatron.recipes.decoding_settings import settings_given, settings_model
from setdiff_megatron.sampling.decoding import SETTINGS, DecodingConfig

__all__ = ["CompletionBody", "ChatBody", "ChatMessage", "RequestError", "decoding_of", "validation_message"]


class RequestError(Exception):
    """A bad request: answered with HTTP `status` and an OpenAI error object."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind


class _OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # OpenAI fields refused unless left at their defaults
    logprobs: Any = None
    logit_bias: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def check_unsupported(self) -> None:
        for name, default in (
            ("logprobs", None),
            ("logit_bias", None),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
        ):
            if getattr(self, name) not in (default, False, 0, {}):
                raise RequestError(f"{name} is not supported by this server", param=name)

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


KNOBS = tuple(name for name, setting in SETTINGS.items() if setting.openai is None)
"""Set diffusion's decoding settings that OpenAI's API has no field for: extra body fields."""

_Body = settings_model("_Body", KNOBS, base=_OpenAIBody)
"""OpenAI's fields and set diffusion's knobs; a knob left out keeps the model's policy, null
turns an optional one off."""


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | None = None
    segments: list[str | int] | None = None
    """Visible text and span lengths to infill, e.g. ["def f(x):\\n", 12, "\\n"]: instead of prompt."""
    suffix: str | None = None
    """OpenAI's insert mode: the completion of max_tokens tokens is infilled between prompt and suffix."""
    echo: bool = False
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise RequestError("echo is not supported by this server", param="echo")
        if self.best_of not in (None, 1):
            raise RequestError("best_of > 1 is not supported by this server", param="best_of")
        if (self.prompt is None) == (self.segments is None):
            raise RequestError("give exactly one of prompt and segments", param="prompt")
        if self.segments is not None and (
            self.suffix is not None
            or not self.segments
            or any(isinstance(s, bool) or (isinstance(s, int) and s < 1) for s in self.segments)
        ):
            raise RequestError(
                "segments must be a non-empty list of strings and span lengths >= 1 (and excludes suffix)",
                param="segments",
            )
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise RequestError(
                "one prompt per request: send a list of one string, or use n for several completions", param="prompt"
            )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise RequestError("only text content parts are supported", param="messages")
            return "".join(parts)
        return self.content or ""


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def decoding_of(body: _Body, defaults: DecodingConfig, *, max_tokens: int, seed: int) -> DecodingConfig:
    """The request's DecodingConfig: its knobs and OpenAI fields over the served model's policy."""
    try:
        return defaults.with_settings(
            {
                **settings_given(body, KNOBS),
                "temperature": body.temperature,
                "top_p": None if body.top_p >= 1 else body.top_p,
                "max_new_tokens": max_tokens,
                "seed": seed,
            }
        )
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def validation_message(exc: ValidationError | Any) -> tuple[str, str | None]:
    """(OpenAI-style message, the offending parameter) of a pydantic validation error."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if err["type"] == "missing":
        return f"Missing required parameter: {param}", param
    return f"Invalid value for {param}: {err['msg'].removeprefix('Value error, ')}", param
