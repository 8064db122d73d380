"""The OpenAI-compatible HTTP front end of `setdiff serve` (FastAPI + uvicorn).

Serves /v1/completions (a prompt, or segments to infill), /v1/chat/completions (HTTP 400 without
a chat template), /v1/models, /health and Prometheus /metrics. A request becomes `n` jobs, each
dealt to the least loaded replica (replicas.py). A stream sends only the completion's longest
contiguous decided prefix; EOS and stop strings apply to that prefix alone. A bad request gets an
OpenAI-style error with HTTP 400, and the server keeps serving (docs/serving.md, "Serving").
"""

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from setdiff_megatron.data.chat import ChatError
from setdiff_megatron.data.supervised import RowFormat, chat_prompt
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import require
from setdiff_megatron.inference.prompts import infill_prompt
from setdiff_megatron.recipes.decoding_settings import with_stops
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sample_request import RequestLimits
from setdiff_megatron.serving.prometheus import ServingStats, exposition, metrics_registry
from setdiff_megatron.serving.protocol import ChatBody, CompletionBody, RequestError, decoding_of, validation_message
from setdiff_megatron.serving.replicas import Job, Replica
from setdiff_megatron.serving.responses import (
    ChatResponses,
    ChoiceText,
    CompletionResponses,
    Responses,
    Usage,
    error_json,
    model_list,
)

require("fastapi", "serve", "setdiff serve")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

__all__ = ["Server", "create_app", "ServedModel"]

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default max_tokens for completions."""


@dataclass
class ServedModel:
    """What the front end knows of the model: its name, tokenizer, limits and default policy."""

    name: str
    tokenizer: SetDiffTokenizer
    context_len: int
    defaults: DecodingConfig
    chat_template: str | None = None
    kv_budget: int | None = None
    prompt_format: RowFormat = field(default_factory=RowFormat)
    """How text prompts begin, as the model's training rows did (recipe_data.py prompt_format)."""


@dataclass
class _Choice:
    """One job of a request, as its stream and its result build up."""

    key: str
    index: int
    tokens: list[int] = field(default_factory=list)
    sent: int = 0
    """Characters of the text already streamed."""
    done: dict | None = None
    stopped: str | None = None
    """The stop string that cut the text, if any."""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)


class Server:
    """Requests in, jobs out to the replicas, events back to the waiting requests."""

    def __init__(self, model: ServedModel, make_replicas):
        """`make_replicas(on_event)` builds the replicas once the event loop runs."""
        self.model, self._make_replicas = model, make_replicas
        self.replicas: list[Replica] = []
        self.limits = RequestLimits(
            mask_token_id=model.tokenizer.mask_id, context_len=model.context_len, kv_budget=model.kv_budget
        )  # the engines' rules, checked here before a request is queued
        self.choices: dict[str, _Choice] = {}
        self.owner: dict[str, int] = {}
        self.outstanding: list[int] = []
        self.stats = ServingStats()
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.replicas = self._make_replicas(self.on_event)
        self.outstanding = [0] * len(self.replicas)
        self.stats.rows = sum(r.max_rows or 0 for r in self.replicas)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """The app's lifespan: the replicas start once the event loop runs (their events come back
        through it) and close when the app shuts down."""
        self.start()
        yield
        self.close()

    # ---- events from the replicas (any thread) ---------------------------------------------

    def on_event(self, event: tuple, replica: int = 0) -> None:
        self.loop.call_soon_threadsafe(self._dispatch, event, replica)

    def _dispatch(self, event: tuple, replica: int) -> None:
        kind, key, payload = event
        if kind == "stats":
            self.stats.load[replica] = payload
            return
        if kind == "lost":  # the replica's processes ended: its jobs cannot finish
            for k in [k for k, r in self.owner.items() if r == replica]:
                self.owner.pop(k)
                if k in self.choices:
                    self.choices[k].events.put_nowait(("lost", None))
            return
        choice = self.choices.get(key)
        if kind == "done":
            self.stats.finished(payload)
            if key in self.owner:
                self.outstanding[self.owner.pop(key)] -= 1
        if choice is not None:
            choice.events.put_nowait((kind, payload))

    # ---- requests -----------------------------------------------------------------------------

    def completion_prompt(self, body: CompletionBody) -> tuple[list[int], int]:
        """(prompt token ids with MASK spans, generated tail length) of a completion request:
        segments and OpenAI's suffix mode infill spans (the spans are the completion, no tail);
        a plain prompt gets a tail of max_tokens."""
        tok = self.model.tokenizer
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        fmt = self.model.prompt_format
        if body.segments is not None:
            return infill_prompt(body.segments, tok, fmt), 0
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if any(not 0 <= t < tok.vocab_size or t == tok.mask_id for t in prompt):
                raise RequestError("prompt token ids must be in the vocabulary and not MASK", param="prompt")
            ids = list(prompt)
        else:
            ids = fmt.prompt(tok.encode(prompt)).tolist()
        if body.suffix is not None:  # insert mode: max_tokens tokens infilled before the suffix
            return ids + [tok.mask_id] * max_tokens + tok.encode(body.suffix), 0
        return ids, max_tokens

    def chat_prompt(self, body: ChatBody) -> list[int]:
        """The model's chat template with its generation prompt, markup as special tokens (the
        way supervised chat records were rendered for training). A model without one is refused,
        as OpenAI-compatible servers refuse it: any rendering made up here is text it never saw."""
        if not self.model.chat_template:
            raise RequestError(
                f"The model '{self.model.name}' has no chat template (its tokenizer_config.json declares "
                "no 'chat_template'), so chat messages cannot be rendered as it was trained; send a text "
                "prompt to /v1/completions instead",
                param="messages",
            )
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return chat_prompt(self.model.chat_template, messages, self.model.tokenizer, self.model.prompt_format)
        except ChatError as exc:
            raise RequestError(str(exc), param="messages") from None

    def chat_max_tokens(self, body: ChatBody, prompt: list[int]) -> int:
        """The request's limit, or as much as the context leaves after the prompt and one window."""
        if body.limit is not None:
            return body.limit
        return max(1, self.model.context_len - 1 - len(prompt) - self.model.defaults.window)

    def jobs(self, body, prompt: list[int], max_tokens: int) -> list[_Choice]:
        """Check the request and make its n jobs (seeds: seed + i, or random ones)."""
        if body.model != self.model.name:
            raise RequestError(
                f"The model '{body.model}' does not exist; this server serves '{self.model.name}'",
                param="model",
                code="model_not_found",
            )
        body.check_unsupported()
        tok = self.model.tokenizer
        base_seed = body.seed if body.seed is not None else random.randrange(2**31)
        cfg = decoding_of(body, self.model.defaults, max_tokens=max_tokens, seed=base_seed)
        cfg = with_stops(cfg, tok, body.stops, skip_unusable=True)
        problem = self.limits.problem(prompt, cfg)
        if problem:
            raise RequestError(
                f"The prompt {problem}",
                param="prompt",
                code="context_length_exceeded" if "longer than the context" in problem else None,
            )
        rid = uuid.uuid4().hex[:24]
        choices = []
        for i in range(body.n):
            choice = _Choice(key=f"{rid}-{i}", index=i)
            self.choices[choice.key] = choice
            job = Job(
                key=choice.key,
                prompt=tuple(prompt),
                cfg=DecodingConfig(**{**cfg.__dict__, "seed": base_seed + i}),
                stream=body.stream,
            )
            replica = min(range(len(self.replicas)), key=lambda r: self.outstanding[r])
            self.outstanding[replica] += 1
            self.owner[choice.key] = replica
            self.replicas[replica].submit(job)
            choices.append(choice)
        self.stats.requests += 1
        return choices

    def cancel(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.done is None and c.key in self.owner:
                self.replicas[self.owner[c.key]].cancel(c.key)
            self.choices.pop(c.key, None)

    def text_of(self, choice: _Choice, stops: list[str]) -> str:
        """The completion so far (held back at a split character), cut at the first stop string."""
        text = self.model.tokenizer.decode(choice.tokens, skip_special_tokens=True)
        if choice.done is None:
            text = text.rstrip("\ufffd")
        ends = [i for i in (text.find(s) for s in stops) if i >= 0]
        if ends:
            choice.stopped = stops[[text.find(s) for s in stops].index(min(ends))]
            return text[: min(ends)]
        return text

    async def wait(self, choice: _Choice, stops: list[str]) -> AsyncIterator[str]:
        """Text deltas of one job as its decided prefix grows, until it is done or stopped."""
        while True:
            kind, payload = await choice.events.get()
            if kind == "lost":
                raise RequestError("the model replica serving this request stopped", status=500, kind="server_error")
            if kind == "progress":
                choice.tokens += payload
            else:  # an infill's text is its spans; a completion's, its tail
                choice.done = payload
                choice.tokens = list(payload["completion"]) or [t for span in payload["spans"] for t in span]
            text = self.text_of(choice, stops)
            if len(text) > choice.sent:
                yield text[choice.sent :]
                choice.sent = len(text)
            if choice.done is not None or choice.stopped is not None:
                return


def _finish_reason(choice: _Choice) -> str:
    """OpenAI's finish reason: "stop" at a stop string or EOS, "length" where the tokens ran out."""
    if choice.stopped is not None:
        return "stop"
    return "stop" if choice.done and choice.done["finish_reason"] == "stop" else "length"


@dataclass
class _Reply:
    """One request's answer: its jobs awaited whole, or streamed as server-sent events."""

    server: Server
    body: CompletionBody | ChatBody
    prompt: list[int]
    choices: list[_Choice]
    responses: Responses

    async def whole(self) -> dict:
        """Every choice's final text; cancelling frees the bookkeeping (and a row still decoding
        after a stop string), also when the client went away."""
        try:
            for c in self.choices:
                async for _ in self.server.wait(c, self.body.stops):
                    pass
        finally:
            self.server.cancel(self.choices)
        return self.responses.response(
            [ChoiceText(c.index, self.server.text_of(c, self.body.stops), _finish_reason(c)) for c in self.choices],
            self.usage(),
        )

    async def events(self) -> AsyncIterator[str]:
        """The choices' deltas as they come, interleaved; an error ends the stream."""
        queue: asyncio.Queue[ChoiceText | RequestError] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, queue)) for c in self.choices]
        try:
            for chunk in self.responses.opening_chunks([c.index for c in self.choices]):
                yield _sse(chunk)
            while not (all(t.done() for t in tasks) and queue.empty()):
                item = await queue.get()
                if isinstance(item, RequestError):
                    yield _sse(error_json(str(item), kind="server_error"))
                    break
                yield _sse(self.responses.chunk(item))
            if self.body.include_usage:
                yield _sse(self.responses.usage_chunk(self.usage()))
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: the rows free at the next step
            for t in tasks:
                t.cancel()
            self.server.cancel(self.choices)

    async def _pump(self, choice: _Choice, queue: asyncio.Queue) -> None:
        """One choice's deltas into the stream's queue, then its finish, or the error that ended it."""
        try:
            async for text in self.server.wait(choice, self.body.stops):
                await queue.put(ChoiceText(choice.index, text, None))
            await queue.put(ChoiceText(choice.index, "", _finish_reason(choice)))
        except RequestError as exc:
            await queue.put(exc)

    def usage(self) -> Usage:
        """Prompt and completion tokens, and what the finished jobs cost (NFE, tokens per step)."""
        tok = self.server.model.tokenizer
        completion = sum(
            len(tok.encode(self.server.text_of(c, []))) if c.stopped else len(c.tokens) for c in self.choices
        )
        done = [c.done for c in self.choices if c.done]
        decoded, steps = sum(d["num_decoded"] for d in done), sum(d["steps"] for d in done)
        return Usage(
            prompt_tokens=len(self.prompt),
            completion_tokens=completion,
            total_tokens=len(self.prompt) + completion,
            nfe=sum(d["nfe"] for d in done),
            tokens_per_step=round(decoded / max(steps, 1), 4),
        )


async def _reply(
    server: Server, body: CompletionBody | ChatBody, prompt: list[int], max_tokens: int, responses: type[Responses]
) -> dict | StreamingResponse:
    """Start the request's jobs; answer whole, or with a stream the jobs feed."""
    choices = server.jobs(body, prompt, max_tokens)
    reply = _Reply(server, body, prompt, choices, responses(choices[0].key.split("-")[0], server.model.name))
    if body.stream:
        return StreamingResponse(reply.events(), media_type="text/event-stream")
    return await reply.whole()


def create_app(server: Server) -> FastAPI:
    """The FastAPI application around `server`."""
    app = FastAPI(title="setdiff serve", lifespan=server.lifespan)
    _answer_errors(app, server)
    _route_status(app, server)
    _route_completions(app, server)
    return app


def _answer_errors(app: FastAPI, server: Server) -> None:
    """Bad requests, malformed or refused, get OpenAI's error objects and count as errors."""

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        server.stats.errors += 1
        return JSONResponse(error_json(str(exc), param=exc.param, code=exc.code, kind=exc.kind), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return await refused(request, RequestError(message, param=param))


def _route_status(app: FastAPI, server: Server) -> None:
    """/health, /v1/models and /metrics (from a registry of this app's own)."""
    registry = metrics_registry(server.stats)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return model_list(server.model.name)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = exposition(registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)


def _route_completions(app: FastAPI, server: Server) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody) -> dict | StreamingResponse:
        body.check_unsupported()
        prompt, max_tokens = server.completion_prompt(body)
        return await _reply(server, body, prompt, max_tokens, CompletionResponses)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody) -> dict | StreamingResponse:
        prompt = server.chat_prompt(body)
        return await _reply(server, body, prompt, server.chat_max_tokens(body, prompt), ChatResponses)


def _sse(payload: dict) -> str:
    """One server-sent event, as OpenAI's streams frame their chunks."""
    return f"data: {json.dumps(payload)}\n\n"
