"""Checkpoint saves in the background against synchronous ones: how long the step loop stands still.

The tiny megatron recipe (recipes/tiny-cpu.yaml, one process) with its model widened until a
checkpoint (weights, fp32 main copy, two Adam moments: about 16 bytes a parameter) matters,
trained twice for the same steps, saving every `--interval` steps: with checkpoint.async_save
false and true. From each run's metrics.jsonl: per save, the time the step loop was blocked
(`checkpoint/blocked_s`) and the time until the checkpoint was published (`checkpoint/write_s`),
and the step times around the saves (a background writer shares the cores with training). The
last save of a run is synchronous in both (training has ended), so the ratio is over the others.

    python -m benchmarks.async_checkpoint [--hidden 1024 --layers 8 --steps 9 --interval 3] [--plain-optimizer]

What a background save still costs the step loop is the part megatron-core does before its
writer starts: the sharded state dict (with the distributed optimizer in its fully reshardable
format, the Adam state gathered to data-parallel rank 0) and the write plan with its staging
copies; `--plain-optimizer` measures the same model without the distributed optimizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.machine import machine_info, save_results
from setdiff_megatron.errors import ArgumentParser

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-cpu.yaml"


def run(directory: Path, cache: Path, args: argparse.Namespace, async_save: bool) -> list[dict]:
    overrides = [
        f"checkpoint.dir={directory}",
        f"data.cache_dir={cache}",
        "launch.nproc_per_node=1",
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.intermediate_size={4 * args.hidden}",
        "parallel.micro_batch_size=2",
        "parallel.global_batch_size=2",
        f"train.steps={args.steps}",
        f"checkpoint.interval={args.interval}",
        "checkpoint.keep_last_n=2",
        "eval.interval=100000",
        "log.interval=1",
        "log.tensorboard=false",
        "train.precision=fp32",
        f"checkpoint.async_save={str(async_save).lower()}",
        f"parallel.distributed_optimizer={str(not args.plain_optimizer).lower()}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "setdiff_megatron.cli", "train", str(RECIPE), *overrides], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (directory / "logs" / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict], final_step: int) -> dict:
    saves = [r for r in rows if "checkpoint/step" in r and r["checkpoint/step"] != final_step]
    steps = {r["step"]: r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r}
    saved = {s["checkpoint/step"] for s in saves}
    after = [t for step, t in steps.items() if step - 1 in saved]
    quiet = [t for step, t in steps.items() if step not in saved and step - 1 not in saved and step > 1]
    return {
        "saves": len(saves),
        "blocked_s": statistics.mean(s["checkpoint/blocked_s"] for s in saves),
        "write_s": statistics.mean(s["checkpoint/write_s"] for s in saves),
        "step_after_save_s": statistics.mean(after) if after else None,
        "step_s": statistics.median(quiet) if quiet else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--plain-optimizer", action="store_true", help="parallel.distributed_optimizer=false")
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "data"
        results = {
            mode: summary(run(Path(tmp) / mode, cache, args, mode == "async"), args.steps) for mode in ("sync", "async")
        }
        size = sum(
            f.stat().st_size
            for f in (Path(tmp) / "sync" / "checkpoints").glob(f"step_{args.steps:08d}/**/*")
            if f.is_file()
        )
    optimizer = "plain" if args.plain_optimizer else "distributed"
    print(
        f"model: hidden {args.hidden} x {args.layers} layers, {optimizer} optimizer; checkpoint "
        f"{size / 2**20:.0f} MiB; {args.steps} steps, a save every {args.interval}"
    )
    print(f"{'saves':>6} {'blocked s':>10} {'written s':>10} {'step after s':>13} {'step s':>8}")
    for mode, r in results.items():
        print(
            f"{mode:>6} {r['blocked_s']:>10.2f} {r['write_s']:>10.2f} {r['step_after_save_s'] or 0:>13.2f} "
            f"{r['step_s'] or 0:>8.2f}"
        )
    ratio = results["sync"]["blocked_s"] / results["async"]["blocked_s"]
    print(f"blocked time, synchronous / background: {ratio:.2f}x")
    path = save_results(
        "async_checkpoint" + ("_plain_optimizer" if args.plain_optimizer else ""),
        {"args": vars(args), "checkpoint_bytes": size, "runs": results, "blocked_ratio": ratio},
    )
    print(f"results: {path}")
    return {"runs": results, "blocked_ratio": ratio, "checkpoint_bytes": size}


if __name__ == "__main__":
    main()
