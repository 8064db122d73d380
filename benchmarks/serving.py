"""Serving: continuous against static batching, over HTTP on loopback, on one request set.

Two `setdiff serve` processes run in turn over the same model and batch size, one with
`--batching continuous` (requests join a running batch) and one with `--batching static` (a
batch runs until its last row ends; the rows that finish first wait). `--clients` concurrent
clients (the real `openai` client, streaming) send the same list of requests to each: prompts
and output budgets of mixed lengths, and EOS where the model stops by itself. The table gives
throughput (completion tokens per second of wall time), latency p50/p99, and time to first
token (the first streamed prefix) p50/p99. Targets: continuous batching at least 1.0x static
throughput, with p99 time to first token at most half of static's. Both servers decode with the
same `--compile` mode (default off: an `auto` server would compile its busy buckets in the
middle of the measured run).

The prompts are problems of the built-in reasoning corpus, and the default source is the README's
main job (`runs/tiny-reasoning`), which answers them and stops with EOS after `#### answer`, so
the outputs vary in length below their budgets.

    python -m benchmarks.serving [--source runs/tiny-reasoning] [--requests 96] [--clients 16]
                                 [--batch-size 16] [--compile off]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path

from benchmarks.machine import machine_info, save_results
from setdiff_megatron.errors import ArgumentParser

DEFAULT_SOURCE = Path("runs/tiny-reasoning")


def request_set(count: int, seed: int = 0) -> list[dict]:
    """(prompt, max_tokens) pairs of mixed lengths: reasoning problems of 2-4 operations."""
    from setdiff_megatron.data.reasoning import TRAIN_LEVELS, problems

    rng = random.Random(seed)
    out = []
    for i, p in enumerate(problems(seed + 99, TRAIN_LEVELS, count)):
        out.append({"prompt": p.prompt, "max_tokens": rng.choice([8, 16, 32, 48]) if i % 3 else 48})
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_clients(url: str, model: str, requests: list[dict], clients: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    todo, lock, records = list(enumerate(requests)), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, req = todo.pop(0)
            start, first, tokens = time.perf_counter(), None, 0
            stream = client.completions.create(
                model=model,
                prompt=req["prompt"],
                max_tokens=req["max_tokens"],
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter() - start
            with lock:
                records.append(
                    {"index": i, "latency_s": end, "ttft_s": first if first is not None else end, "tokens": tokens}
                )

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latency, ttft = [r["latency_s"] for r in records], [r["ttft_s"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p99_s": percentile(latency, 0.99),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "mean_tokens": statistics.mean(r["tokens"] for r in records),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--compile", default="off", choices=["off", "auto", "on"])
    args = parser.parse_args(argv)
    if not args.source.exists():
        raise SystemExit(
            f"benchmarks.serving: no model at {args.source}; train the README's main job first "
            "(setdiff train recipes/tiny-reasoning.yaml) or pass --source"
        )
    from setdiff_megatron.serving.live_server import LiveServer

    requests = request_set(args.requests)
    print("machine:", machine_info())
    print(
        f"source {args.source}; {len(requests)} requests (max_tokens 8-48, EOS after the answer), "
        f"{args.clients} concurrent streaming clients, batch size {args.batch_size}"
    )
    rows = {}
    for batching in ("continuous", "static"):
        live = LiveServer(
            args.source, "--batch-size", str(args.batch_size), "--batching", batching, "--compile", args.compile
        )
        try:
            run_clients(live.url, live.model_name, requests[: args.clients], args.clients)  # warm-up
            rows[batching] = run_clients(live.url, live.model_name, requests, args.clients)
        finally:
            live.stop()
    print(
        f"{'batching':>10} {'tokens/s':>9} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>8} {'ttft p99':>8} {'tok/req':>7}"
    )
    for name, r in rows.items():
        print(
            f"{name:>10} {r['tokens_per_s']:>9.1f} {r['latency_p50_s']:>8.2f} {r['latency_p99_s']:>8.2f} "
            f"{r['ttft_p50_s']:>8.2f} {r['ttft_p99_s']:>8.2f} {r['mean_tokens']:>7.1f}"
        )
    ratio = rows["continuous"]["tokens_per_s"] / rows["static"]["tokens_per_s"]
    ttft = rows["continuous"]["ttft_p99_s"] / rows["static"]["ttft_p99_s"]
    print(
        f"continuous / static throughput: {ratio:.2f}x (target >= 1.0x); p99 time to first token: "
        f"{ttft:.2f} of static's (target <= 0.5)"
    )
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "continuous_vs_static": ratio,
        "ttft_p99_vs_static": ttft,
    }
    print(f"results: {save_results('serving', result)}")
    return result


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    return [
        ("serving throughput, continuous vs static batching", result["continuous_vs_static"], ">=", 1.0),
        ("serving p99 time to first token, continuous / static", result["ttft_p99_vs_static"], "<=", 0.5),
    ]


if __name__ == "__main__":
    main()
