"""The benchmark suite: every CPU benchmark in one run, then each target with its ratio.

    python -m benchmarks [--quick] [--only attention sampling ...]

Each benchmark prints its own table (baseline, ours, ratio, machine) and writes
benchmarks/results/<name>.json; this runner adds benchmarks/results/summary.json with the
targets of the project. Run it on a quiet machine: every ratio compares two measurements of
the same run, but other load on the cores skews both unevenly.
"""

from __future__ import annotations

import argparse

from benchmarks import (
    attention,
    context_parallel,
    long_context,
    memory,
    moe_step,
    parallel_scaling,
    sampling,
    supervised_packing,
    train_throughput,
)
from benchmarks.machine import machine_info, save_results
from setdiff_megatron.errors import ArgumentParser

# name -> (module, extra arguments of a --quick run). Each module has main(argv) -> result and
# targets(result) -> [(target, value, "<=" or ">=", goal)].
BENCHMARKS = {
    "attention": (attention, ["--repeats", "1", "--lengths", "256", "1024"]),
    "train_throughput": (train_throughput, ["--repeats", "1"]),
    "sampling": (sampling, ["--repeats", "1", "--new-tokens", "16", "--batches", "1", "16"]),
    "memory": (memory, ["--lengths", "1024", "--contexts", "256"]),
    "parallel_scaling": (parallel_scaling, ["--repeats", "1"]),
    "moe_step": (moe_step, ["--steps", "1"]),
    "context_parallel": (context_parallel, ["--length", "2048", "--repeats", "1"]),
    "long_context": (long_context, ["--contexts", "4096"]),
    "supervised_packing": (supervised_packing, ["--repeats", "1"]),
}


def verdicts(rows: list[tuple[str, float | None, str, float]]) -> list[dict]:
    return [
        {
            "target": name,
            "value": value,
            "goal": f"{op} {goal}",
            "met": None if value is None else (value >= goal if op == ">=" else value <= goal),
        }
        for name, value, op, goal in rows
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat each, fewer shapes (a smoke run)")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run these benchmarks only")
    args = parser.parse_args(argv)
    targets = []
    for name in args.only or BENCHMARKS:
        module, quick_args = BENCHMARKS[name]
        print(f"\n== {name} ==")
        targets += verdicts(module.targets(module.main(quick_args if args.quick else [])))
    print("\nmachine:", machine_info())
    for t in targets:
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"  {t['target']:<78} {value:>7}  (goal {t['goal']}): {verdict}")
    if not args.only:
        path = save_results("summary", {"quick": args.quick, "targets": targets})
        print(f"summary: {path}")
    return {"targets": targets}


if __name__ == "__main__":
    main()
