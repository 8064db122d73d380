"""Parallel scaling on CPU gloo: the TP=2 and PP=2 optimizer step against the ideal split.

With P ranks on P cores, the ideal split of a step is the single-process step time with ONE
thread divided by P: perfect division of the work, zero communication, zero pipeline bubble.
Measured, all with the same model, weights and batches (seeded) and one thread per process:
  T1     one process, tp=1 pp=1, the global batch of M micro-batches
  TP=2   two processes, tp=2 (and tp=2 with sequence parallelism), the same global batch
  PP=2   two processes, pp=2, 1F1B over the same M micro-batches; its bubble-adjusted ideal,
         T1 / 2 * (M + P - 1) / M, is reported as well
Each layout runs in fresh processes (megatron's CPU mode and parallel state are per process),
built exactly as `setdiff train` builds them (benchmarks.megatron_step); each rank times
best-of-N full optimizer steps after a warm-up, with a barrier after every step, and rank 0
reports. ratio = measured / ideal. Target: TP=2 and PP=2 within 1.3x of the ideal split.

At hidden size 256 (the default, as in the other benchmarks) a TP rank's GEMMs are small next to
its all-reduces; --hidden-size 512 shows the same layouts where tensor parallelism starts to pay.

    python -m benchmarks.parallel_scaling [--repeats 3] [--hidden-size 256]
"""

from __future__ import annotations

import argparse
import os
import resource
from dataclasses import dataclass
from multiprocessing.queues import SimpleQueue

import torch
import torch.multiprocessing as mp

from benchmarks.machine import best_time, machine_info, save_results
from setdiff_megatron.distributed.runtime import free_port
from setdiff_megatron.errors import ArgumentParser

MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4}
VOCAB_SIZE, MASK_TOKEN_ID = 4097, 4096
LENGTH, MICRO_BATCH, NUM_MICROBATCHES = 256, 4, 8


@dataclass(frozen=True)
class Workload:
    """The sequence length and global batch a layout steps over (benchmarks.context_parallel
    takes long sequences)."""

    length: int = LENGTH
    micro_batch: int = MICRO_BATCH
    num_microbatches: int = NUM_MICROBATCHES
    model: tuple[tuple[str, int], ...] = ()
    """Overrides of MODEL, as (field, value) pairs."""


LAYOUTS = {  # name: (world size, parallel section)
    "T1 (1 process)": (1, {}),
    "TP=2": (2, {"tp": 2}),
    "TP=2 + SP": (2, {"tp": 2, "sequence_parallel": True}),
    "PP=2": (2, {"pp": 2}),
}
TARGET = 1.3


def recipe_dict(parallel: dict, hidden_size: int, work: Workload = Workload()) -> dict:
    """The benchmark's recipe under one layout; everything but the layout is shared."""
    return {
        "model": MODEL | dict(work.model) | {"hidden_size": hidden_size, "max_seq_len": work.length},
        "data": {"seq_len": work.length},
        "train": {"precision": "fp32", "steps": 10, "warmup_steps": 0},
        "parallel": {
            "micro_batch_size": work.micro_batch,
            "global_batch_size": work.micro_batch * work.num_microbatches,
            **parallel,
        },
    }


def global_batch(work: Workload = Workload()) -> list:
    """The same M micro-batches for every layout and rank: TP ranks and pipeline stages all
    draw the whole micro-batch (forward_step), so every rank rebuilds it from the seed."""
    from setdiff_megatron.core.orders import Staggered
    from setdiff_megatron.core.streams import sample_two_stream_batch

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MASK_TOKEN_ID, (work.num_microbatches, work.micro_batch, work.length), generator=gen)
    return [sample_two_stream_batch(t, Staggered(d=4), mask_token_id=MASK_TOKEN_ID, generator=gen) for t in tokens]


def _rank(
    rank: int, world: int, port: int, parallel: dict, hidden_size: int, repeats: int, out: SimpleQueue, work: Workload
) -> None:
    """One rank of a layout: join the group as `setdiff train` does, time best-of-N steps, and
    report the step time and rank 0's peak memory growth over the steps (bytes)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    from setdiff_megatron.distributed.megatron_cpu import prepare_megatron_import

    prepare_megatron_import()  # before megatron's imports, which warn (a spawned process starts unfiltered)
    import torch.distributed as dist

    from benchmarks.megatron_step import megatron_step
    from setdiff_megatron.distributed.runtime import shutdown

    recipe = recipe_dict(parallel, hidden_size, work)
    step, _ = megatron_step(recipe, vocab_size=VOCAB_SIZE, mask_token_id=MASK_TOKEN_ID, batches=global_batch(work))

    def synced_step() -> None:
        # The trailing barrier starts every rank's next step together: a step ends for all when
        # the slowest rank ends it, so rank 0's time is the layout's step time.
        step()
        dist.barrier()

    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = best_time(synced_step, repeats=repeats)
    if rank == 0:
        out.put((seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024))
    shutdown()


def layout_run(
    world: int, parallel: dict, hidden_size: int, repeats: int, work: Workload = Workload()
) -> tuple[float, int]:
    """(best step time, peak memory growth of rank 0 over the steps) of one layout, in `world`
    fresh spawned processes of one thread each."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(
        _rank,
        args=(world, free_port(), parallel, hidden_size, repeats, out, work),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return out.get()


def rows_from(seconds: dict[str, float]) -> list[dict]:
    """Each parallel layout against T1 / 2; PP=2 also against its 1F1B bubble-adjusted ideal."""
    t1 = seconds["T1 (1 process)"]
    rows = [{"layout": "T1 (1 process)", "seconds": t1, "ideal_seconds": t1, "ratio": 1.0}]
    for name, (world, parallel) in list(LAYOUTS.items())[1:]:
        ideal = t1 / world
        row = {"layout": name, "seconds": seconds[name], "ideal_seconds": ideal, "ratio": seconds[name] / ideal}
        if parallel.get("pp", 1) > 1:
            bubble_ideal = ideal * (NUM_MICROBATCHES + parallel["pp"] - 1) / NUM_MICROBATCHES
            row |= {"bubble_ideal_seconds": bubble_ideal, "ratio_vs_bubble_ideal": seconds[name] / bubble_ideal}
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'layout':<16} {'ideal s':>9} {'ours s':>9} {'ratio':>7} {'bubble-adj ideal s':>19} {'ratio':>7}")
    for r in rows:
        bubble = (
            f"{r['bubble_ideal_seconds']:>19.3f} {r['ratio_vs_bubble_ideal']:>6.2f}x"
            if "bubble_ideal_seconds" in r
            else ""
        )
        print(f"{r['layout']:<16} {r['ideal_seconds']:>9.3f} {r['seconds']:>9.3f} {r['ratio']:>6.2f}x {bubble}")


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    """The suite's targets: TP=2 and PP=2 step time within TARGET x of the ideal split."""
    ratio = {r["layout"]: r["ratio"] for r in result["rows"]}
    return [
        ("TP=2 step time vs ideal split, CPU gloo", ratio.get("TP=2"), "<=", TARGET),
        ("PP=2 step time vs ideal split, CPU gloo", ratio.get("PP=2"), "<=", TARGET),
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=MODEL["hidden_size"])
    args = parser.parse_args(argv)
    model = MODEL | {"hidden_size": args.hidden_size}
    print("machine:", machine_info())
    print(
        f"model: {model}, vocab {VOCAB_SIZE}, L={LENGTH}; {NUM_MICROBATCHES} micro-batches of {MICRO_BATCH}; "
        f"fp32 AdamW step, 1 thread per process, best of {args.repeats}; ideal = T1 / ranks"
    )
    seconds = {
        name: layout_run(world, parallel, args.hidden_size, args.repeats)[0]
        for name, (world, parallel) in LAYOUTS.items()
    }
    rows = rows_from(seconds)
    print_table(rows)
    name = "parallel_scaling" if args.hidden_size == MODEL["hidden_size"] else f"parallel_scaling_h{args.hidden_size}"
    path = save_results(
        name,
        {
            "args": vars(args),
            "model": model | {"vocab_size": VOCAB_SIZE, "seq_len": LENGTH},
            "micro_batch_size": MICRO_BATCH,
            "num_microbatches": NUM_MICROBATCHES,
            "threads_per_process": 1,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
