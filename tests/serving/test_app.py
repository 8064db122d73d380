"""`setdiff serve` against the real `openai` client, on 127.0.0.1: completions, chat, streaming,
stops, n > 1, seeds, usage, errors, cancellation, queueing, replicas, and a bounded load test.

The server is a real subprocess over the session's tiny trained run (tests/conftest.py); its
greedy answers are compared with the sampler's own decode of the same prompt.
"""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serving tests use the openai client (part of the dev extra)")

from setdiff_megatron.checkpoint.manifest import write_manifest  # noqa: E402
from setdiff_megatron.checkpoint.names import TOKENIZER_DIR  # noqa: E402
from setdiff_megatron.checkpoint.resolve import resolve_step_dir  # noqa: E402
from setdiff_megatron.data.supervised import chat_prompt  # noqa: E402
from setdiff_megatron.distributed.runtime import Ranks  # noqa: E402
from setdiff_megatron.inference.sampling_model import load_sampling_model  # noqa: E402
from setdiff_megatron.recipe_data import prompt_format  # noqa: E402
from setdiff_megatron.sampling.decoding import DecodingConfig  # noqa: E402
from setdiff_megatron.sampling.sampler import SetSampler  # noqa: E402
from setdiff_megatron.serving.live_server import LiveServer  # noqa: E402
from setdiff_megatron.sources.read import read_source  # noqa: E402

pytestmark = pytest.mark.multiproc

NAME = "tiny"


def Live(source, *args):  # noqa: N802 - reads like the class it makes
    return LiveServer(source, *args, model_name=NAME)


@pytest.fixture(scope="module")
def server(trained_run):
    live = Live(trained_run, "--batch-size", "4")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def reference(trained_run):
    """The sampler decoding prompts in this process, as the server's engine should."""
    sm = load_sampling_model(trained_run, Ranks(), device="cpu")
    defaults = read_source(trained_run, weights=False).decoding
    sampler = SetSampler(sm.model, mask_token_id=sm.tokenizer.mask_id, context_len=sm.config.max_seq_len)

    def decode(prompt: str, max_tokens: int, **knobs) -> str:
        cfg = DecodingConfig(
            **{
                **defaults.__dict__,
                "temperature": 0.0,
                "max_new_tokens": max_tokens,
                "eos_token_ids": (sm.tokenizer.eos_id,),
                **knobs,
            }
        )
        row = sampler.generate([sm.tokenizer.encode(prompt)], cfg).rows[0]
        return sm.tokenizer.decode(row.completion, skip_special_tokens=True)

    return decode


def test_completion_equals_the_samplers_decode_and_reports_usage(server, reference):
    r = server.client.completions.create(
        model=NAME,
        prompt="def fibonacci(n):\n",
        max_tokens=16,
        temperature=0,
        extra_body={"window": 4, "threshold": 0.3},
    )
    assert r.choices[0].text == reference("def fibonacci(n):\n", 16, window=4, threshold=0.3)
    assert r.object == "text_completion" and r.model == NAME and r.choices[0].finish_reason in ("stop", "length")
    usage = r.usage.model_dump()
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["nfe"] >= 1 and usage["tokens_per_step"] >= 1.0


def test_streaming_sends_the_growing_decided_prefix(server):
    kwargs = dict(model=NAME, prompt="class Point:\n", max_tokens=24, temperature=0, extra_body={"window": 8})
    whole = server.client.completions.create(**kwargs).choices[0].text
    chunks = list(server.client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole and len(texts) >= 2
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_chat_without_a_chat_template_is_a_400_that_says_why(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    with pytest.raises(openai.BadRequestError) as err:
        server.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "messages"
    assert err.value.body["message"].startswith(f"The model '{NAME}' has no chat template"), err.value.body
    assert server.client.models.list().data[0].id == NAME


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_checkpoint(trained_run, tmp_path_factory) -> Path:
    """The run's newest checkpoint, copied, its tokenizer declaring a chat template (the copy's
    manifest written anew)."""
    step = resolve_step_dir(trained_run)
    copy = tmp_path_factory.mktemp("chat") / step.name
    shutil.copytree(step, copy)
    config = copy / TOKENIZER_DIR / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE}))
    write_manifest(copy, collective=False)
    return copy


def test_chat_renders_the_models_template_and_streams(chat_checkpoint):
    """The answer is the completion of the rendered template's token ids, whole or streamed."""
    source = read_source(chat_checkpoint, weights=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    ids = chat_prompt(CHAT_TEMPLATE, messages, source.tokenizer, prompt_format(source.recipe, source.tokenizer))
    live = Live(chat_checkpoint)
    try:
        r = live.client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids)
        same = live.client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == same.choices[0].text
        streamed = live.client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    finally:
        live.stop()


def test_stop_strings_cut_the_text(server):
    free = server.client.completions.create(model=NAME, prompt="def f(x):\n", max_tokens=24, temperature=0).choices[0]
    stop = free.text[5:8]
    assert stop.strip(), "the free completion should have text to stop at"
    cut = server.client.completions.create(
        model=NAME, prompt="def f(x):\n", max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == free.text[: free.text.find(stop)] and cut.finish_reason == "stop"


def test_n_choices_and_seeds_reproduce(server):
    def sample(seed):
        r = server.client.completions.create(
            model=NAME, prompt="import ", max_tokens=12, temperature=1.0, n=3, seed=seed
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(7)
    assert len(first) == 3 and sample(7) == first and sample(8) != first
    assert len(set(first)) > 1  # each choice draws with its own seed (seed + index)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(prompt="x", max_tokens=4, extra_body={"bogus": 1}), "Unrecognized request argument supplied: bogus"),
        (dict(prompt="x", max_tokens=4, extra_body={"window": 0}), "window"),
        (dict(prompt="x = 1\n" * 200, max_tokens=4), "longer than the context"),
        (dict(prompt="x", max_tokens=4, model="nope"), "does not exist"),
        (dict(prompt="x", max_tokens=4, logprobs=2), "logprobs is not supported"),
    ],
)
def test_bad_requests_get_400_and_the_server_stays_up(server, kwargs, fragment):
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(**{"model": NAME, **kwargs})
    assert err.value.status_code == 400 and fragment in err.value.body["message"], err.value.body
    assert server.client.models.list().data[0].id == NAME


def test_infill_through_suffix_and_segments(server):
    a = server.client.completions.create(
        model=NAME, prompt="def g(", suffix="):\n    return 1\n", max_tokens=5, temperature=0
    )
    b = server.client.completions.create(
        model=NAME,
        prompt=None,
        max_tokens=0,
        temperature=0,
        extra_body={"segments": ["def g(", 5, "):\n    return 1\n"]},
    )
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 5


def test_a_dropped_stream_frees_its_row_and_waiting_requests_complete(trained_run):
    live = Live(trained_run, "--batch-size", "1")
    try:
        stream = live.client.completions.create(
            model=NAME, prompt="def f(x):\n", max_tokens=100, stream=True, temperature=0, extra_body={"window": 1}
        )
        next(iter(stream))
        stream.response.close()  # the client goes away mid-stream
        results = []

        def ask(i: int) -> None:
            results.append(
                live.client.completions.create(model=NAME, prompt=f"x{i} = ", max_tokens=8, temperature=0)
                .choices[0]
                .text
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]  # one row: two of them wait
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 3
        deadline = time.monotonic() + 10
        while live.metrics()["setdiff_jobs_running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        metrics = live.metrics()
        assert metrics["setdiff_jobs_running"] == 0 and metrics["setdiff_queue_depth"] == 0
        assert metrics["setdiff_requests_total"] == 4
    finally:
        live.stop()


def test_bounded_load_stops_by_itself(server):
    """At most 60 s and 48 requests from 8 concurrent clients, mixed prompts and lengths."""
    deadline, done, failures = time.monotonic() + 60, [], []

    def client(i: int) -> None:
        for j in range(6):
            if time.monotonic() > deadline:
                return
            try:
                r = server.client.completions.create(
                    model=NAME, prompt="x = 1\n" * (1 + (i + j) % 5), max_tokens=4 + 5 * ((i * j) % 4), temperature=0
                )
                done.append(r.usage.completion_tokens)
            except Exception as exc:  # noqa: BLE001 - a failure is what the test counts
                failures.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not failures and len(done) >= 8 and not any(t.is_alive() for t in threads)


@pytest.mark.slow  # 24 s; one replica's answers are tested by default
def test_data_parallel_replicas_and_a_tp_model_answer_alike(trained_run, server):
    kwargs = dict(model=NAME, prompt="def fibonacci(n):\n", max_tokens=12, temperature=0)
    want = server.client.completions.create(**kwargs).choices[0].text
    for args in (["--nproc", "2"], ["--nproc", "2", "--tp", "2"]):
        live = Live(trained_run, *args, "--batch-size", "2")
        try:
            got = [live.client.completions.create(**kwargs).choices[0].text for _ in range(3)]
            assert got == [want] * 3, args
        finally:
            live.stop()
