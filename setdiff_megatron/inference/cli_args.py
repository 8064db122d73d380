"""Command-line options shared by `setdiff sample` and the `setdiff eval` jobs: where the model
runs (processes, TP, shards, device) and how it decodes (DecodingConfig)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.sampling.decoding import SETTINGS, Setting
from setdiff_megatron.sampling.step_compiler import COMPILE_MODES
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value_type(setting: Setting):
    """Parses a flag's value: its kind, or `off`/`none` where the setting can be off (the range
    is checked with the others, in `decoding_from_args`)."""

    def parse(text: str):
        if setting.off and text.lower() in ("off", "none"):
            return None
        try:
            return setting.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {setting.allowed()}, got {text!r}") from None

    parse.__name__ = setting.kind.__name__
    return parse


def add_decoding_arguments(parser: argparse.ArgumentParser, *, max_new_tokens: int = 64) -> None:
    """One flag per decoding setting (sampling/decoding.py SETTINGS). A flag left out keeps the
    model's own policy (its recipe or generation config); `--max-new-tokens` has this command's
    default."""
    dec = parser.add_argument_group(
        "decoding (sampling/decoding.py): each flag changes one setting over the model's own policy "
        "(docs/sampling.md, 'Where the decoding policy comes from')"
    )
    for setting in SETTINGS.values():
        help_text = setting.help + ("; none turns it off" if setting.off else "")
        if setting.kind is bool:
            dec.add_argument(
                _flag(setting.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        elif setting.name == "max_new_tokens":
            dec.add_argument(
                _flag(setting.name),
                type=_value_type(setting),
                default=max_new_tokens,
                help=f"{help_text}; default {max_new_tokens}",
            )
        else:
            dec.add_argument(_flag(setting.name), type=_value_type(setting), default=argparse.SUPPRESS, help=help_text)
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


def decoding_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The decoding settings the command line gave, by name, each checked: the job applies them
    over the model's own policy."""
    given = {name: getattr(args, name) for name in SETTINGS if hasattr(args, name)}
    for name, value in given.items():
        if not SETTINGS[name].accepts(value):
            raise UserError(f"decoding option: {name} must be {SETTINGS[name].allowed()}; got {value!r}")
    return given


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


def relaunch(args: argparse.Namespace, out: str | None = None) -> int | None:
    """Own the job's output (`out`, default --out; a shard's own lock with --shard), then, with
    --nproc > 1 and no launcher around, run this same command as --nproc torchrun processes and
    return their exit code; otherwise None (this process does the work)."""
    from setdiff_megatron.distributed.ownership import hold

    if args.nproc < 1:
        raise UserError(f"--nproc must be >= 1 (the local processes to start); got {args.nproc}")
    target = out or args.out
    if getattr(args, "shard", None) is not None:
        target = f"{target}.shard-{args.shard}-of-{args.num_shards}"
    hold(target)
    if args.nproc == 1 or "RANK" in os.environ:
        return None
    from setdiff_megatron.distributed.workers import Torchrun

    # Each process runs the command without --nproc (torchrun would also take it for its own option).
    return Torchrun(args.nproc, _without_option(args.argv, "--nproc")).run()
