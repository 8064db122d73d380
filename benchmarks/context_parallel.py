"""Context parallelism on CPU gloo: the CP=2 optimizer step at a long sequence against the ideal
split, and the peak memory of a rank against CP=1.

The same machinery as benchmarks.parallel_scaling (fresh processes of one thread each, the step
`setdiff train` builds, best of N after a warm-up, a barrier after every step): T1 is one
process at cp=1, CP=2 two processes splitting every sequence into zigzag chunks with set-causal
ring attention between them (kernels/ring_attention.py). ideal = T1 / 2; ratio = measured /
ideal. Memory: the growth of rank 0's peak resident memory over the timed steps (activations,
gradients and the optimizer's first state), CP=1 against CP=2. A small model (hidden 64, 2
layers, 2 heads) keeps a step at L = 8192 (16,384 tokens inside the model) to seconds.

    python -m benchmarks.context_parallel [--length 8192] [--repeats 2]
"""

from __future__ import annotations

import argparse

from benchmarks.machine import machine_info, save_results
from benchmarks.parallel_scaling import Workload, layout_run
from setdiff_megatron.errors import ArgumentParser

MODEL = (("num_layers", 2), ("num_heads", 2))
HIDDEN_SIZE = 64
TARGET = 1.3
"""CP=2 within 1.3x of the ideal split, the parallel_scaling target of TP and PP."""


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    work = Workload(length=args.length, micro_batch=1, num_microbatches=2, model=MODEL)
    print("machine:", machine_info())
    print(
        f"model: hidden {HIDDEN_SIZE}, {dict(MODEL)}, L={args.length} (2L = {2 * args.length} tokens); "
        f"2 micro-batches of 1; fp32 AdamW step, 1 thread per process, best of {args.repeats}; ideal = T1 / 2"
    )
    t1, mem1 = layout_run(1, {}, HIDDEN_SIZE, args.repeats, work)
    t2, mem2 = layout_run(2, {"cp": 2}, HIDDEN_SIZE, args.repeats, work)
    rows = [
        {"layout": "T1 (1 process)", "seconds": t1, "ideal_seconds": t1, "ratio": 1.0, "peak_growth_bytes": mem1},
        {
            "layout": "CP=2",
            "seconds": t2,
            "ideal_seconds": t1 / 2,
            "ratio": t2 / (t1 / 2),
            "peak_growth_bytes": mem2,
            "memory_ratio": mem1 / max(mem2, 1),
        },
    ]
    print(f"{'layout':<16} {'ideal s':>9} {'ours s':>9} {'ratio':>7} {'peak growth MB':>15}")
    for r in rows:
        print(
            f"{r['layout']:<16} {r['ideal_seconds']:>9.3f} {r['seconds']:>9.3f} {r['ratio']:>6.2f}x "
            f"{r['peak_growth_bytes'] / 2**20:>15.1f}"
        )
    print(f"peak memory growth per rank: CP=1 / CP=2 = {rows[1]['memory_ratio']:.2f}x")
    name = "context_parallel" if args.length == 8192 else f"context_parallel_L{args.length}"
    path = save_results(name, {"args": vars(args), "hidden_size": HIDDEN_SIZE, "model": dict(MODEL), "rows": rows})
    print(f"results: {path}")
    return {"rows": rows, "length": args.length}


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    return [
        (f"CP=2 step time vs ideal split at L={result['length']}, CPU gloo", result["rows"][1]["ratio"], "<=", TARGET)
    ]


if __name__ == "__main__":
    main()
