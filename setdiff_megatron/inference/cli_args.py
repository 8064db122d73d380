"""Command-line options shared by `setdiff sample` and the `setdiff eval` jobs: where the model
runs (processes, TP, shards, device) and how it decodes (DecodingConfig)."""

from __future__ import annotations

import argparse
import os

from setdiff_megatron.core.decoding import DecodingConfig
from setdiff_megatron.core.step_compiler import COMPILE_MODES
from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.sources.base_model import add_base_argument

__all__ = ["add_job_arguments", "add_decoding_arguments", "decoding_from_args", "placement_from_args", "relaunch"]


def add_job_arguments(parser: argparse.ArgumentParser, *, source: bool = True, batch_size: bool = True) -> None:
    """The options of `Placement` (and the model source, unless the job names its own)."""
    if source:
        parser.add_argument(
            "source", help="checkpoint run directory, step_* directory, Hugging Face export or SetDLM release"
        )
    add_base_argument(parser)
    group = parser.add_argument_group("processes")
    group.add_argument("--nproc", type=int, default=1, help="start this many local processes (torchrun)")
    group.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size (megatron model); the processes are split into tp x data-parallel",
    )
    group.add_argument("--shard", type=int, default=None, help="do only this shard (e.g. $SLURM_ARRAY_TASK_ID)")
    group.add_argument("--num-shards", type=int, default=None, help="number of explicit shards")
    if batch_size:
        group.add_argument("--batch-size", type=int, default=16, help="examples processed together (default 16)")
    group.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    group.add_argument(
        "--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on GPUs, fp32 on CPUs"
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument(
        "--compile",
        default="auto",
        choices=list(COMPILE_MODES),
        help="decode steps at bucketed static shapes, compiled (TP=1, the torch model): auto compiles "
        "a bucket once its eager steps have taken what a compile costs, so a short job never does; "
        "on compiles at first use; off never (docs/sampling.md)",
    )


def add_decoding_arguments(parser: argparse.ArgumentParser, *, max_new_tokens: int = 64) -> None:
    dec = parser.add_argument_group("decoding (core/decoding.py DecodingConfig)")
    dec.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        help=f"generated tail per prompt (0: infill only; default {max_new_tokens})",
    )
    dec.add_argument(
        "--window",
        type=int,
        default=16,
        help="W: queries per step come from the W positions "
        "right of the leftmost masked one; 1 is autoregressive decoding",
    )
    dec.add_argument("--fill-window", action="store_true", help="always offer W masked positions")
    dec.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="block diffusion decoding: queries stay in the "
        "block of S positions holding the leftmost masked one (for block-order models)",
    )
    dec.add_argument("--tokens-per-step", type=int, default=1, help="k: decode the k most confident queries")
    dec.add_argument(
        "--threshold", type=float, default=None, help="tau in (0, 1]: also decode every query at least this confident"
    )
    dec.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    dec.add_argument("--top-k", type=int, default=None)
    dec.add_argument("--top-p", type=float, default=None)
    dec.add_argument("--repetition-penalty", type=float, default=1.0)
    dec.add_argument("--seed", type=int, default=0)
    dec.add_argument("--ignore-eos", action="store_true", help="do not stop a completion at the EOS token")
    dec.add_argument("--context-len", type=int, default=None, help="default: the model's max_seq_len")
    bos = dec.add_mutually_exclusive_group()
    bos.add_argument(
        "--add-bos",
        dest="add_bos",
        action="store_true",
        default=None,
        help="start prompts with BOS (default: as the model was trained)",
    )
    bos.add_argument("--no-add-bos", dest="add_bos", action="store_false")


def placement_from_args(args: argparse.Namespace, **changes) -> Placement:
    return Placement(
        batch_size=getattr(args, "batch_size", Placement.batch_size),
        tp=args.tp,
        shard=args.shard,
        num_shards=args.num_shards,
        device=args.device,
        dtype=args.dtype,
        progress=not args.no_progress,
        compile=args.compile,
        **changes,
    )


def decoding_from_args(args: argparse.Namespace) -> DecodingConfig:
    try:
        return DecodingConfig(
            window=args.window,
            fill_window=args.fill_window,
            block_size=args.block_size,
            tokens_per_step=args.tokens_per_step,
            threshold=args.threshold,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UserError(f"decoding option: {exc}") from None


def _without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without `name VALUE` / `name=VALUE`."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == name:
            i += 2
            continue
        if not argv[i].startswith(name + "="):
            out.append(argv[i])
        i += 1
    return out


def relaunch(args: argparse.Namespace) -> int | None:
    """With --nproc > 1 and no launcher around, run this same command as --nproc torchrun
    processes and return their exit code; otherwise None (this process does the work)."""
    if args.nproc < 1:
        raise UserError(f"--nproc must be >= 1 (the local processes to start); got {args.nproc}")
    if args.nproc == 1 or "RANK" in os.environ:
        return None
    from setdiff_megatron.distributed.workers import Torchrun

    # Each process runs the command without --nproc (torchrun would also take it for its own option).
    return Torchrun(args.nproc, _without_option(args.argv, "--nproc")).run()
