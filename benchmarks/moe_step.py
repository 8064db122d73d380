"""MoE step time against a dense model of the same active parameters, and the token dispatcher's share.

Three workloads with the same attention, embeddings, recipe and batches as parallel_scaling (its
8 micro-batches of 4 x 256) at hidden size 128, one thread per process, each built as `setdiff
train` builds it (benchmarks.megatron_step: megatron DDP, the pipeline schedule over the
set-diffusion forward_step and loss, the AdamW update):
  dense      SwiGLU MLPs of 512
  MoE EP=1   every MLP 8 SwiGLU experts of 256, top-2: the same active parameters; one process
  MoE EP=2   the same MoE in two processes over gloo: 4 experts each, the micro-batches split
             between them (data parallelism 2), tokens exchanged by all-to-all
Each world runs in fresh processes under torchrun: dense and MoE EP=1 share one process, their
steps interleaved so that a slow spell of the machine hits both; MoE EP=2 has a barrier after
every step, and rank 0 reports.
Each workload: one warm-up step, then the median of --steps steps.

The dispatcher's share of a step is the wall time inside the six methods MoELayer calls on
megatron's MoEAlltoAllTokenDispatcher (permutation, all-to-all, sort by local expert, and their
inverses) over the step time, forward and backward: a call's backward counts from the gradient
reaching its outputs to the gradient leaving its inputs.

Ratios: MoE EP=1 / dense, and MoE EP=2 / (MoE EP=1 / 2), the ideal split. No target: the figures
go to results/moe_step.json.

    python -m benchmarks.moe_step [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.machine import machine_info, save_results
from benchmarks.parallel_scaling import (
    LENGTH,
    MASK_TOKEN_ID,
    MICRO_BATCH,
    MODEL,
    NUM_MICROBATCHES,
    VOCAB_SIZE,
    global_batch,
    recipe_dict,
)
from setdiff_megatron.distributed.workers import Torchrun
from setdiff_megatron.errors import ArgumentParser

ROOT = Path(__file__).parents[1]
HIDDEN_SIZE = 128
DENSE = {"intermediate_size": 512}
MOE = DENSE | {"num_experts": 8, "moe_top_k": 2, "moe_intermediate_size": 256}
DISPATCH_METHODS = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


class DispatcherClock:
    """Seconds spent in the token dispatchers since the last reset, forward and backward. The
    CPU autograd engine runs one node at a time, latest-created first, so between a call's
    output and input gradients it runs that call's backward and, in practice, nothing else."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, method: Callable) -> Callable:
        def call(*args, **kwargs):
            window = _BackwardWindow(self)
            args = tuple(window.ends_at(a) for a in args)
            start = time.perf_counter()
            out = method(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            for t in out if isinstance(out, tuple) else (out,):
                if _has_grad(t):
                    t.register_hook(window.start)
            return out

        return call


class _BackwardWindow:
    """One dispatcher call's backward: from its first output gradient to its last input gradient."""

    def __init__(self, clock: DispatcherClock) -> None:
        self.clock, self.started, self.pending = clock, None, 0

    def ends_at(self, arg):
        """A view of a differentiable input, hooked: the input itself may feed the router too,
        and its gradient would then wait for the router's backward."""
        if not _has_grad(arg):
            return arg
        self.pending += 1
        view = arg.view_as(arg)
        view.register_hook(self.end)
        return view

    def start(self, grad: torch.Tensor) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def end(self, grad: torch.Tensor) -> None:
        self.pending -= 1
        if not self.pending and self.started is not None:
            self.clock.seconds += time.perf_counter() - self.started


def _has_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def time_dispatchers() -> DispatcherClock:
    """Wrap MoEAlltoAllTokenDispatcher's methods in this (benchmark worker) process."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    clock = DispatcherClock()
    for name in DISPATCH_METHODS:
        setattr(MoEAlltoAllTokenDispatcher, name, clock.timed(getattr(MoEAlltoAllTokenDispatcher, name)))
    return clock


def median_steps(steps: dict[str, Callable[[], None]], clock: DispatcherClock, count: int) -> dict[str, dict]:
    """Median step time and dispatcher share of each workload, their steps interleaved (as in
    machine.best_times); the median, not the best, so that the share belongs to typical steps."""
    for step in steps.values():
        step()
    runs = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            clock.seconds = 0.0
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            runs[name].append((seconds, clock.seconds / seconds))
    return {
        name: {"seconds": statistics.median(s for s, _ in r), "dispatcher_share": statistics.median(d for _, d in r)}
        for name, r in runs.items()
    }


def synced(step: Callable[[], None]) -> Callable[[], None]:
    """The step, then a barrier: a step ends for every rank when the slowest ends it, so rank 0's
    time is the step's."""
    import torch.distributed as dist

    def run() -> None:
        step()
        dist.barrier()

    return run


def _worker(out: Path, ep: int, count: int) -> None:
    """One rank: dense and MoE at EP=1 in a world of one, MoE alone at EP=2 in a world of two."""
    torch.set_num_threads(1)
    from setdiff_megatron.distributed.megatron_cpu import prepare_megatron_import

    prepare_megatron_import()  # before megatron's imports, which warn
    from benchmarks.megatron_step import megatron_step
    from setdiff_megatron.distributed.runtime import rank, shutdown, world_size

    models = {"MoE": MOE} if ep > 1 else {"dense": DENSE, "MoE": MOE}
    batches = global_batch()[rank() :: world_size()]
    steps, params = {}, {}
    for name, model in models.items():
        recipe = recipe_dict({"ep": ep}, HIDDEN_SIZE)
        recipe["model"] |= model
        step, cfg = megatron_step(recipe, vocab_size=VOCAB_SIZE, mask_token_id=MASK_TOKEN_ID, batches=batches)
        steps[name] = synced(step)
        params[name] = {"active_params": cfg.num_params(active=True), "total_params": cfg.num_params()}
    results = median_steps(steps, time_dispatchers(), count)
    if rank() == 0:
        out.write_text(
            json.dumps({f"{name} EP={ep}" if name == "MoE" else name: results[name] | params[name] for name in models})
        )
    shutdown()


def run_workers(ep: int, count: int, directory: Path) -> dict[str, dict]:
    """The worker's results at expert parallelism `ep`, in `ep` fresh processes (megatron's CPU
    mode and parallel state are per process)."""
    out = directory / f"ep{ep}.json"
    argv = Torchrun(
        ep, ["--worker", str(out), "--ep", str(ep), "--steps", str(count)], module="benchmarks.moe_step"
    ).argv
    subprocess.run(argv, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(out.read_text())


def rows_from(results: dict[str, dict]) -> list[dict]:
    """MoE EP=1 against dense; MoE EP=2 against the ideal split of MoE EP=1."""
    dense, ep1 = results["dense"]["seconds"], results["MoE EP=1"]["seconds"]
    against = {"dense": ("-", dense), "MoE EP=1": ("dense", dense), "MoE EP=2": ("MoE EP=1 / 2", ep1 / 2)}
    rows = []
    for name, (baseline, seconds) in against.items():
        r = results[name]
        rows.append(
            {
                "workload": name,
                "processes": 2 if name == "MoE EP=2" else 1,
                **r,
                "baseline": baseline,
                "ratio": r["seconds"] / seconds,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'workload':<10} {'procs':>5} {'active':>9} {'total':>9} {'step s':>7} {'against':>13} {'ratio':>7} "
        f"{'dispatcher':>10}"
    )
    for r in rows:
        share = f"{r['dispatcher_share']:>10.1%}" if r["workload"] != "dense" else f"{'-':>10}"
        print(
            f"{r['workload']:<10} {r['processes']:>5} {r['active_params']:>9,} {r['total_params']:>9,} "
            f"{r['seconds']:>7.3f} {r['baseline']:>13} {r['ratio']:>6.2f}x {share}"
        )


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    """None: the project sets no goal for the MoE step yet."""
    return []


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per workload, after one warm-up")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.ep, args.steps)
        return {}
    print("machine:", machine_info())
    print(
        f"model: hidden {HIDDEN_SIZE}, {MODEL['num_layers']} layers, vocab {VOCAB_SIZE}, L={LENGTH}; "
        f"dense {DENSE}, MoE {MOE}; {NUM_MICROBATCHES} micro-batches of {MICRO_BATCH}; fp32 AdamW step, "
        f"1 thread per process, median of {args.steps}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = run_workers(1, args.steps, Path(tmp)) | run_workers(2, args.steps, Path(tmp))
    rows = rows_from(results)
    print_table(rows)
    path = save_results(
        "moe_step",
        {
            "args": {"steps": args.steps},
            "hidden_size": HIDDEN_SIZE,
            "dense": DENSE,
            "moe": MOE,
            "threads_per_process": 1,
            "rows": rows,
        },
    )
    print(f"results: {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
