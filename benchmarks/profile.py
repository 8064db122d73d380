"""Where the time goes: torch.profiler over a training step and over a sampling run.

    python -m benchmarks.profile [--rows 15]

Profiles the benchmarks' own workloads (benchmarks/train_throughput.py's torch-model step with
the fused attention at L=256, batch 8; benchmarks/sampling.py's 16 prompts decoded at batch 16)
and prints each one's operators by self CPU time. The tables and Chrome traces go to
benchmarks/results/profiles/ (open a trace in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from benchmarks import sampling, train_throughput
from benchmarks.machine import RESULTS_DIR, machine_info
from setdiff_megatron.errors import ArgumentParser


def training_step():
    length, batch = train_throughput.SHAPES[0]
    return train_throughput.torch_step("fused", length, batch)


def sampling_run():
    sampler, prompts, cfg = sampling.setup(sampling.parse_args([]))
    return lambda: sampler.generate(prompts, cfg, batch_size=16)


def profile_one(name: str, fn, rows: int) -> str:
    fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    out = RESULTS_DIR / "profiles"
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / f"{name}.trace.json"))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    (out / f"{name}.txt").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    for name, fn in (("training_step", training_step()), ("sampling_batch16", sampling_run())):
        print(f"\n== {name}\n{profile_one(name, fn, args.rows)}")


if __name__ == "__main__":
    main()
