"""The OpenAI-compatible HTTP front end of `setdiff serve` (FastAPI + uvicorn).

    POST /v1/completions        prompt (or segments to infill), non-streaming or SSE streaming
    POST /v1/chat/completions   messages through the tokenizer's chat template, or a plain
                                "role: content" transcript where the tokenizer has none
    GET  /v1/models   /health   /metrics (Prometheus text: requests, queue depth, tokens/s,
                                tokens per step, batch occupancy)

A request becomes `n` jobs, dealt to the least loaded replica (replicas.py). Streaming: set
diffusion decodes in any order, so a stream sends the completion's longest contiguous decided
prefix as it grows; EOS and stop strings apply to that prefix only, never to a token decoded
ahead of a gap. A client that goes away has its jobs cancelled: their rows free at the next
step. Every response carries usage: prompt and completion tokens, plus NFE and tokens per step.
Bad requests get OpenAI-style error objects with HTTP 400, and the server keeps serving.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations, and the
# routes are defined inside create_app, whose local names (Request) a string annotation cannot see.
import asyncio
import itertools
import json
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from setdiff_megatron.core.decoding import DecodingConfig
from setdiff_megatron.core.sampler import SetSampler
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import require
from setdiff_megatron.serving.protocol import (ChatBody, CompletionBody, RequestError, decoding_of, error_body,
                                               validation_message)
from setdiff_megatron.serving.replicas import Job, Replica

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


class _Stats:
    def __init__(self) -> None:
        self.requests = self.errors = self.tokens = self.steps_sum = 0
        self.tokens_per_step_sum, self.jobs_done = 0.0, 0
        self.recent: deque[tuple[float, int]] = deque()
        self.load: dict[int, dict] = {}

    def finished(self, summary: dict) -> None:
        self.tokens += summary["num_decoded"]
        self.jobs_done += 1
        self.tokens_per_step_sum += summary["num_decoded"] / max(summary["steps"], 1)
        now = time.monotonic()
        self.recent.append((now, summary["num_decoded"]))
        while self.recent and now - self.recent[0][0] > 60:
            self.recent.popleft()

    def tokens_per_s(self) -> float:
        if len(self.recent) < 2:
            return 0.0
        span = max(self.recent[-1][0] - self.recent[0][0], 1e-9)
        return sum(n for _, n in list(self.recent)[1:]) / span


class Server:
    """Requests in, jobs out to the replicas, events back to the waiting requests."""

    def __init__(self, model: ServedModel, make_replicas):
        """`make_replicas(on_event)` builds the replicas once the event loop runs."""
        self.model, self._make_replicas = model, make_replicas
        self.replicas: list[Replica] = []
        self.checker = SetSampler(None, mask_token_id=model.tokenizer.mask_id, context_len=model.context_len,
                                  kv_budget=model.kv_budget)  # no model: it only checks requests
        self.choices: dict[str, _Choice] = {}
        self.owner: dict[str, int] = {}
        self.outstanding: list[int] = []
        self.stats = _Stats()
        self.loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.replicas = self._make_replicas(self.on_event)
        self.outstanding = [0] * len(self.replicas)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

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
        if body.segments is not None:
            ids = []
            for segment in body.segments:
                ids += tok.encode(segment) if isinstance(segment, str) else [tok.mask_id] * segment
            return ids, 0
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if any(not 0 <= t < tok.vocab_size or t == tok.mask_id for t in prompt):
                raise RequestError("prompt token ids must be in the vocabulary and not MASK", param="prompt")
            ids = list(prompt)
        else:
            ids = tok.encode(prompt)
        if body.suffix is not None:  # insert mode: max_tokens tokens infilled before the suffix
            return ids + [tok.mask_id] * max_tokens + tok.encode(body.suffix), 0
        return ids, max_tokens

    def chat_prompt(self, body: ChatBody) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if self.model.chat_template:
            jinja2 = require("jinja2", "serve", "Chat templates")
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(self.model.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.model.tokenizer.encode(text)

    def jobs(self, body, prompt: list[int], max_tokens: int) -> list[_Choice]:
        """Check the request and make its n jobs (seeds: seed + i, or random ones)."""
        if body.model != self.model.name:
            raise RequestError(f"The model '{body.model}' does not exist; this server serves '{self.model.name}'",
                               param="model", code="model_not_found")
        body.check_unsupported()
        tok = self.model.tokenizer
        base_seed = body.seed if body.seed is not None else random.randrange(2**31)
        cfg = decoding_of(body, self.model.defaults, max_tokens=max_tokens, seed=base_seed)
        stops = tuple(s for s in (tuple(tok.encode(text)) for text in body.stops) if s and tok.mask_id not in s)
        cfg = DecodingConfig(**{**cfg.__dict__, "eos_token_ids": (tok.eos_id,), "stop_sequences": stops})
        problem = self.checker.request_problem(prompt, cfg)
        if problem:
            raise RequestError(f"The prompt {problem}", param="prompt", code="context_length_exceeded"
                               if "longer than the context" in problem else None)
        rid = uuid.uuid4().hex[:24]
        choices = []
        for i in range(body.n):
            choice = _Choice(key=f"{rid}-{i}", index=i)
            self.choices[choice.key] = choice
            job = Job(key=choice.key, prompt=tuple(prompt), cfg=DecodingConfig(**{**cfg.__dict__, "seed": base_seed + i}),
                      stream=body.stream)
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
            return text[:min(ends)]
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
                yield text[choice.sent:]
                choice.sent = len(text)
            if choice.done is not None or choice.stopped is not None:
                return


def _finish_reason(choice: _Choice) -> str:
    if choice.stopped is not None:
        return "stop"
    return "stop" if choice.done and choice.done["finish_reason"] == "stop" else "length"


def _usage(prompt: list[int], choices: list[_Choice], server: Server) -> dict[str, Any]:
    completion = sum(len(server.model.tokenizer.encode(server.text_of(c, []))) if c.stopped else
                     len(c.tokens) for c in choices)
    done = [c.done for c in choices if c.done]
    steps = sum(d["steps"] for d in done)
    decoded = sum(d["num_decoded"] for d in done)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion,
            "nfe": sum(d["nfe"] for d in done), "tokens_per_step": round(decoded / max(steps, 1), 4)}


def create_app(server: Server):
    """The FastAPI application around `server`."""
    fastapi = require("fastapi", "serve", "setdiff serve")
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        server.close()

    app = fastapi.FastAPI(title="setdiff serve", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        message, param = validation_message(exc)
        server.stats.errors += 1
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(request, exc: RequestError):
        server.stats.errors += 1
        return JSONResponse(error_body(str(exc), param=exc.param, code=exc.code, kind=exc.kind),
                            status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model.name, "object": "model", "created": 0,
                                            "owned_by": "setdiff"}]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        s = server.stats
        running = sum(v.get("running", 0) for v in s.load.values())
        waiting = sum(v.get("waiting", 0) for v in s.load.values())
        capacity = sum(r.max_rows or 0 for r in server.replicas) or 1
        lines = [
            ("setdiff_requests_total", "counter", "HTTP requests accepted", s.requests),
            ("setdiff_request_errors_total", "counter", "requests refused", s.errors),
            ("setdiff_jobs_running", "gauge", "rows decoding in the replicas' batches", running),
            ("setdiff_queue_depth", "gauge", "jobs waiting for a row", waiting),
            ("setdiff_tokens_total", "counter", "tokens decoded", s.tokens),
            ("setdiff_tokens_per_second", "gauge", "decoded tokens per second over the last minute", s.tokens_per_s()),
            ("setdiff_tokens_per_step", "gauge", "mean tokens per step of finished jobs",
             s.tokens_per_step_sum / max(s.jobs_done, 1)),
            ("setdiff_batch_occupancy", "gauge", "running rows over the replicas' max rows", running / capacity),
        ]
        text = "".join(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value}\n"
                       for name, kind, help_, value in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def respond(request, body, prompt: list[int], max_tokens: int, chat: bool):
        choices = server.jobs(body, prompt, max_tokens)
        rid, created = ("chatcmpl-" if chat else "cmpl-") + choices[0].key.split("-")[0], int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def choice_json(c: _Choice, text: str, finish: str | None, delta: bool) -> dict:
            if chat:
                content = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
                return {"index": c.index, ("delta" if delta else "message"): content, "finish_reason": finish,
                        "logprobs": None}
            return {"index": c.index, "text": text, "logprobs": None, "finish_reason": finish}

        if not body.stream:
            try:
                for c in choices:
                    async for _ in server.wait(c, body.stops):
                        pass
            except BaseException:
                server.cancel(choices)
                raise
            server.cancel(choices)  # frees the bookkeeping (and a row still decoding after a stop string)
            return {"id": rid, "object": kind, "created": created, "model": server.model.name,
                    "choices": [choice_json(c, server.text_of(c, body.stops), _finish_reason(c), False)
                                for c in choices], "usage": _usage(prompt, choices, server)}

        async def events() -> AsyncIterator[str]:
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(c: _Choice) -> None:
                try:
                    async for text in server.wait(c, body.stops):
                        await queue.put((c, text, None))
                    await queue.put((c, "", _finish_reason(c)))
                except RequestError as exc:
                    await queue.put((c, str(exc), "error"))

            tasks = [asyncio.create_task(pump(c)) for c in choices]
            try:
                if chat:
                    for c in choices:
                        first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        yield _sse({"id": rid, "object": chunk_kind, "created": created, "model": server.model.name,
                                    "choices": [first]})
                for _ in itertools.count():
                    if all(t.done() for t in tasks) and queue.empty():
                        break
                    c, text, finish = await queue.get()
                    if finish == "error":
                        yield _sse(error_body(text, kind="server_error"))
                        break
                    yield _sse({"id": rid, "object": chunk_kind, "created": created, "model": server.model.name,
                                "choices": [choice_json(c, text, finish, True)]})
                if body.include_usage:
                    yield _sse({"id": rid, "object": chunk_kind, "created": created, "model": server.model.name,
                                "choices": [], "usage": _usage(prompt, choices, server)})
                yield "data: [DONE]\n\n"
            finally:  # also when the client went away: the rows free at the next step
                for t in tasks:
                    t.cancel()
                server.cancel(choices)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request, body: CompletionBody):
        body.check_unsupported()
        prompt, max_tokens = server.completion_prompt(body)
        return await respond(request, body, prompt, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request, body: ChatBody):
        limit = body.limit
        max_tokens = server.model.context_len if limit is None else limit
        prompt = server.chat_prompt(body)
        if limit is None:  # as much as the context leaves after the prompt and one window
            max_tokens = max(1, server.model.context_len - 1 - len(prompt) - server.model.defaults.window)
        return await respond(request, body, prompt, max_tokens, chat=True)

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
