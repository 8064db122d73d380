"""The cached sampler at long contexts on the CPU: prefill and decode time, and memory per
cached token.

A small model (hidden 64, 2 layers, 2 query heads sharing 1 key/value head, max_seq_len 32768)
decodes `--new-tokens` tokens after a random prompt filling the rest of the context, batch 1,
window 4, the prompt prefilled in chunks of `--prefill-chunk` tokens (each chunk one step of
commits against the cache, so no step's attention is wider than chunk x context). Memory per
cached token: the KV cache's bytes over its slots (2 x layers x KV heads x head dim x 4 bytes in
fp32, the whole cache preallocated), and the growth of the process's peak resident memory over
the generation divided by the context (the cache plus every transient of prefill and decode).
Under tensor parallelism each rank caches its own KV heads (models/megatron_model.py), 1/tp of it.

    python -m benchmarks.long_context [--contexts 4096 32768] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from benchmarks.machine import machine_info, save_results
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler

VOCAB = 4097


def _model(context: int) -> SetDiffusionTransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        mask_token_id=VOCAB - 1,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_seq_len=context,
    )
    return SetDiffusionTransformer(cfg).eval()


def run(context: int, new_tokens: int, prefill_chunk: int) -> dict:
    model = _model(context)
    caches = []
    allocate = model.new_cache
    model.new_cache = lambda *a, **k: caches.append(allocate(*a, **k)) or caches[-1]  # noqa: E731
    prompt = torch.randint(0, VOCAB - 1, (context - new_tokens,), generator=torch.Generator().manual_seed(1))
    sampler = SetSampler(model, mask_token_id=VOCAB - 1, context_len=context, prefill_chunk=prefill_chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.inference_mode():
        out = sampler.generate([prompt.tolist()], DecodingConfig(window=4, max_new_tokens=new_tokens))
    seconds = time.perf_counter() - start
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    cache = caches[0]
    cache_bytes = cache.keys.nbytes + cache.values.nbytes
    m = out.metrics
    return {
        "context": context,
        "new_tokens": out.rows[0].num_decoded,
        "prefill_s": m.prefill_s,
        "decode_s": seconds - m.prefill_s,
        "decode_tokens_per_s": out.rows[0].num_decoded / (seconds - m.prefill_s),
        "forwards": m.forwards,
        "cache_slots": cache.capacity,
        "cache_bytes_per_token": cache_bytes / cache.capacity,
        "peak_growth_bytes_per_token": growth / context,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    rows = [run(c, args.new_tokens, args.prefill_chunk) for c in args.contexts]
    print(
        f"{'context':>8} {'prefill s':>10} {'decode s':>9} {'tok/s':>7} {'cache B/token':>14} {'peak growth B/token':>20}"
    )
    for r in rows:
        print(
            f"{r['context']:>8} {r['prefill_s']:>10.2f} {r['decode_s']:>9.2f} {r['decode_tokens_per_s']:>7.2f} "
            f"{r['cache_bytes_per_token']:>14.0f} {r['peak_growth_bytes_per_token']:>20.0f}"
        )
    path = save_results("long_context", {"args": vars(args), "rows": rows})
    print(f"results: {path}")
    return {"rows": rows}


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    return []  # no goal yet: the figures are reported as measured


if __name__ == "__main__":
    main()
