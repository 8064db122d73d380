"""Where the time goes: torch.profiler over a training step and over a sampling run.

    python -m benchmarks.profile [--rows 15]

Profiles the benchmarks' own workloads (benchmarks/train_throughput.py's torch-model step with
the fused attention at L=256, batch 8; benchmarks/sampling.py's 16 prompts decoded at batch 16;
benchmarks/reference.py's batch-1 decode, eager, with its shares per step) and prints each one's
operators by self CPU time. The tables and Chrome traces go to
benchmarks/results/profiles/ (open a trace in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from benchmarks import reference, sampling, train_throughput
from benchmarks.machine import RESULTS_DIR, machine_info
from setdiff_megatron.errors import ArgumentParser


def training_step():
    length, batch = train_throughput.SHAPES[0]
    return train_throughput.torch_step("fused", length, batch)


def sampling_run():
    sampler, prompts, cfg = sampling.setup(sampling.parse_args([]))
    return lambda: sampler.generate(prompts, cfg, batch_size=16)


def decoding_batch1():
    """benchmarks/reference.py's decode, eager (what `setdiff sample` runs for a short job): one
    prompt, a step a token; the header gives its shares per decode step."""
    sampler, prompt, decoding = reference.our_decode(reference.spec(), "off")

    def run():
        return sampler.generate([prompt], decoding)

    return run


def step_shares(fn, prof, traced: float) -> str:
    """Per decode step: the wall time of an untraced run and its model forwards' share, and from
    the trace the operator calls and the time inside operators (the rest: Python, dispatch and
    the profiler's own cost). On a CPU a host read of a tensor waits for nothing; on a GPU each
    would be a synchronisation."""
    start = time.perf_counter()
    metrics = fn().metrics
    wall, steps = time.perf_counter() - start, metrics.forwards
    averages = prof.key_averages()
    in_ops = sum(e.self_cpu_time_total for e in averages) / 1e6
    return (
        f"per decode step ({steps} forwards, the prefill included): {wall / steps * 1e3:.3f} ms untraced, "
        f"the model's forward {metrics.forward_s / wall:.0%} of it, bookkeeping the rest; traced: "
        f"{sum(e.count for e in averages) / steps:.0f} operator calls (nested ones included), "
        f"{in_ops / steps * 1e3:.3f} ms inside operators of {traced / steps * 1e3:.3f} ms"
    )


def profile_one(name: str, fn, rows: int) -> str:
    fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        traced = time.perf_counter() - start
    out = RESULTS_DIR / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"{name}.trace.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    if name == "decoding_batch1":
        table = step_shares(fn, prof, traced) + "\n" + table
    (out / f"{name}.txt").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    workloads = (
        ("training_step", training_step()),
        ("sampling_batch16", sampling_run()),
        ("decoding_batch1", decoding_batch1()),
    )
    for name, fn in workloads:
        print(f"\n== {name}\n{profile_one(name, fn, args.rows)}")


if __name__ == "__main__":
    main()
