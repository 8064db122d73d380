"""Sampling throughput: the batched set sampler against a batch-1 loop, eager and compiled.

The reference sampler runs one prompt at a time (docs/method.md, "Differences from the
reference"). The baseline here is our own sampler called once per prompt (batch 1), so both
sides share the model, the weights, the prompts and the decoding policy, and differ only in
batching. Each batch size runs twice: eager steps (`compile="off"`, the sampler as it was), and
static-shape compiled decode steps (`compile="on"`, sampling/step_compiler.py), whose warm-up (the
first run, compiling every bucket it meets) is timed apart. Prompts have mixed lengths; the
random model's confidences are flat, so the set-size policy (k tokens per step in a window of W)
fixes the pace. For every row the table gives tokens/s, the batched forward passes (prefills
included), ms per decode forward, the mean per-row NFE, and bookkeeping (everything outside the
model's step: token selection, stop checks, compaction, host syncs) as a share of decode time.
Targets: compiled batch-1 forwards >= 1.3x faster than eager ones; batch 16 >= 8x the batch-1
tokens/s; bookkeeping <= 10 % of step time at batch 16.

The batching ratio is (batch-1 forwards x their ms/forward) / (batch-16 forwards x theirs): its
ceiling, the ratio of forward counts, is reached only if a forward over 16 rows costs what one
over a single row does; the ms/forward column shows how far from that the model's step is.

    python -m benchmarks.sampling [--batches 1 4 16] [--prompts 16] [--new-tokens 64]
                                  [--hidden-size 128 --num-layers 4] [--modes off on]
"""

from __future__ import annotations

import argparse
import math
import time
from functools import partial

import torch

from benchmarks.machine import best_times, machine_info, save_results
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sample_output import SampleOutput
from setdiff_megatron.sampling.sampler import SetSampler

# The model of recipes/tiny-cpu.yaml: what a CPU user of this project samples from.
MODEL = dict(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    intermediate_size=384,
    vocab_size=2048,
    mask_token_id=2047,
    max_seq_len=128,
)


def fastest_runs(
    samplers: dict[str, SetSampler], prompts: list[list[int]], cfg: DecodingConfig, batches: list[int], repeats: int
) -> dict[tuple[str, int], SampleOutput]:
    """For each (compile mode, batch size), the fastest of `repeats` runs after one warm-up,
    all of them interleaved, as the sampler measured it."""
    outputs: dict[tuple[str, int], list[SampleOutput]] = {(m, b): [] for m in samplers for b in batches}

    def decode(mode: str, batch: int) -> None:
        outputs[mode, batch].append(samplers[mode].generate(prompts, cfg, batch_size=batch))

    best_times({key: partial(decode, *key) for key in outputs}, repeats=repeats)
    return {key: min(outs[1:], key=lambda out: out.metrics.total_s) for key, outs in outputs.items()}


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        **{
            **MODEL,
            "hidden_size": args.hidden_size,
            "num_layers": args.num_layers,
            "intermediate_size": 3 * args.hidden_size,
        }
    )


def setup(args: argparse.Namespace) -> tuple[dict[str, SetSampler], list[list[int]], DecodingConfig]:
    torch.manual_seed(0)
    model = SetDiffusionTransformer(model_config(args)).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, MODEL["max_seq_len"] - args.new_tokens, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, MODEL["mask_token_id"], (n,), generator=gen).tolist() for n in lengths]
    cfg = DecodingConfig(window=args.window, tokens_per_step=args.tokens_per_step, max_new_tokens=args.new_tokens)
    samplers = {
        mode: SetSampler(model, mask_token_id=MODEL["mask_token_id"], context_len=MODEL["max_seq_len"], compile=mode)
        for mode in args.modes
    }
    return samplers, prompts, cfg


def warm_up(samplers: dict[str, SetSampler], prompts: list[list[int]], cfg: DecodingConfig, batches: list[int]) -> dict:
    """Compile every bucket the runs will meet (one run per batch size), timed."""
    compiler = samplers["on"].compiler
    start = time.perf_counter()
    for batch in batches:
        samplers["on"].generate(prompts, cfg, batch_size=batch)
    return {"seconds": time.perf_counter() - start, **compiler.summary()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--tokens-per-step", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=MODEL["hidden_size"])
    parser.add_argument("--num-layers", type=int, default=MODEL["num_layers"])
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["off", "on"],
        choices=["off", "on"],
        help="compile modes to run (off: eager steps; on: compiled static-shape steps)",
    )
    return parser.parse_args(argv)


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    rows = {(r["compile"], r["batch"]): r for r in result["rows"]}
    best = "on" if ("on", 16) in rows else "off"
    out = []
    if ("on", 1) in rows and ("off", 1) in rows:
        out.append(
            (
                "compiled batch-1 decode forward, ms vs eager",
                rows["off", 1]["decode_forward_ms"] / rows["on", 1]["decode_forward_ms"],
                ">=",
                1.3,
            )
        )
    if (best, 16) in rows:
        out += [
            (
                f"sampling tokens/s, batch 16 vs batch 1 (compile {best})",
                rows[best, 16]["speedup_vs_batch1"],
                ">=",
                8.0,
            ),
            (
                f"sampler bookkeeping share of decode time, batch 16 (compile {best})",
                rows[best, 16]["bookkeeping_share"],
                "<=",
                0.10,
            ),
        ]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    samplers, prompts, cfg = setup(args)
    lengths = [len(p) for p in prompts]
    print("machine:", machine_info())
    model = {k: v for k, v in vars(model_config(args)).items() if k in MODEL}
    print(
        f"model: {model}; {args.prompts} prompts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.new_tokens} new tokens each; W={args.window}, k={args.tokens_per_step}, greedy; "
        f"best of {args.repeats}"
    )
    warm = warm_up(samplers, prompts, cfg, args.batches) if "on" in samplers else None
    if warm is not None:
        print(f"warm-up: {warm['buckets']} buckets compiled in {warm['seconds']:.1f} s")
    print(
        f"{'compile':>7} {'batch':>5} {'tokens/s':>9} {'forwards':>8} {'ms/forward':>10} {'row NFE':>7} "
        f"{'tok/step':>8} {'prefill s':>9} {'bookkeeping':>11}"
    )
    rows, reference = [], None
    for (mode, batch), out in fastest_runs(samplers, prompts, cfg, args.batches, args.repeats).items():
        m = out.metrics
        reference = reference or out
        assert [r.tokens for r in out.rows] == [r.tokens for r in reference.rows], (
            "batching or compiling changed the output"
        )
        row = {
            "compile": mode,
            "batch": batch,
            "tokens_per_s": m.tokens_per_s,
            "speedup_vs_batch1": None,
            "forwards": m.forwards,
            "mean_row_nfe": sum(r.nfe for r in out.rows) / len(out.rows),
            "tokens_per_step": m.tokens_per_step,
            "prefill_s": m.prefill_s,
            "total_s": m.total_s,
            "bookkeeping_share": m.bookkeeping_share,
            # Every prompt has visible tokens, so each batch made one prefill forward.
            "decode_forward_ms": 1e3 * m.forward_s / (m.forwards - math.ceil(len(prompts) / batch)),
        }
        rows.append(row)
        print(
            f"{mode:>7} {batch:>5} {m.tokens_per_s:>9.1f} {m.forwards:>8} {row['decode_forward_ms']:>10.3f} "
            f"{row['mean_row_nfe']:>7.1f} {m.tokens_per_step:>8.2f} {m.prefill_s:>9.4f} {m.bookkeeping_share:>10.1%}"
        )
    for mode in samplers:
        baseline = next((r for r in rows if r["batch"] == 1 and r["compile"] == mode), None)
        if baseline is None:
            continue
        for row in (r for r in rows if r["compile"] == mode):
            row["speedup_vs_batch1"] = row["tokens_per_s"] / baseline["tokens_per_s"]
        print(
            f"compile {mode}, tokens/s vs its batch-1 loop: "
            + ", ".join(f"batch {r['batch']}: {r['speedup_vs_batch1']:.2f}x" for r in rows if r["compile"] == mode)
        )
    result = {"rows": rows, "warm_up": warm}
    for name, value, op, goal in targets(result):
        print(f"{name}: {value:.2f} (target {op} {goal})")
    path = save_results("sampling", {"args": vars(args), "model": model, **result})
    print(f"results: {path}")
    return result


if __name__ == "__main__":
    main()
