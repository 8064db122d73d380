"""The benchmark suite: every CPU benchmark in one run, then each target with its ratio.

    python -m benchmarks [--quick]

Each benchmark prints its own table (baseline, ours, ratio, machine) and writes
benchmarks/results/<name>.json; this runner adds benchmarks/results/summary.json with the
targets of the project. Run it on a quiet machine: every ratio compares two measurements of
the same run, but other load on the cores skews both unevenly.
"""

from __future__ import annotations

import argparse

from benchmarks import attention, sampling, train_throughput
from benchmarks.machine import machine_info, save_results


def _targets(results: dict) -> list[dict]:
    attn = {r["L"]: r["ratio"] for r in results["attention"]["rows"]}
    train = [r for r in results["train_throughput"]["rows"] if r["attention"] == "fused"]
    samp = {r["batch"]: r for r in results["sampling"]["rows"]}
    rows = [("set-causal attention fwd+bwd vs masked SDPA, L=1024", attn.get(1024), ">=", 3.0)]
    rows += [(f"training tokens/s vs dense-mask two-stream, {r['body']} L={r['L']}", r["ratio_vs_dense"], ">=", 2.0)
             for r in train]
    if 16 in samp:
        rows += [("sampling tokens/s, batch 16 vs batch 1", samp[16]["speedup_vs_batch1"], ">=", 8.0),
                 ("sampler bookkeeping share of decode time, batch 16", samp[16]["bookkeeping_share"], "<=", 0.10)]
    return [{"target": name, "value": value, "goal": f"{op} {goal}",
             "met": None if value is None else (value >= goal if op == ">=" else value <= goal)}
            for name, value, op, goal in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat each, fewer shapes (a smoke run)")
    args = parser.parse_args(argv)
    repeats = ["--repeats", "1"] if args.quick else []
    results = {
        "attention": attention.main([*repeats, *(["--lengths", "256", "1024"] if args.quick else [])]),
        "train_throughput": train_throughput.main(repeats),
        "sampling": sampling.main(repeats + (["--new-tokens", "16", "--batches", "1", "16"] if args.quick else [])),
    }
    targets = _targets(results)
    print("\nmachine:", machine_info())
    for t in targets:
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"  {t['target']:<70} {value:>7}  (goal {t['goal']}): {verdict}")
    path = save_results("summary", {"quick": args.quick, "targets": targets})
    print(f"summary: {path}")
    return {"targets": targets}


if __name__ == "__main__":
    main()
