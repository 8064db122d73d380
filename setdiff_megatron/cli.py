"""The `setdiff` command.

Each subcommand parses its arguments and calls one library function. Errors a user can fix
(`UserError`) print one line and exit with code 2, once for all the processes of a local launch
(see errors.py). A command that writes into a run or output directory owns it while it runs
(distributed/ownership.py), and every command ends with the process that started it
(distributed/child_processes.py, `follow_parent`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from setdiff_megatron.errors import ArgumentParser, run_reporting
from setdiff_megatron.log import say
from setdiff_megatron.sources.base_model import BASE_ENV, add_base_argument
from setdiff_megatron.version import __version__


def _train(args: argparse.Namespace) -> int:
    import os

    from setdiff_megatron.recipes import check_engine_installed, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    check_engine_installed(recipe)
    if "RANK" not in os.environ and recipe.launch.world_size > 1:
        # Not started by a launcher: start this recipe's processes, each running this command.
        return _launch(args)
    from setdiff_megatron.distributed.megatron_cpu import prepare_megatron_import

    prepare_megatron_import()  # before anything imports megatron-core
    if "RANK" not in os.environ:
        _say_plan(recipe)
    from setdiff_megatron.distributed.signals import Preempted
    from setdiff_megatron.training.trainer import train

    try:
        train(recipe, args.recipe)
    except Preempted as stop:
        say(f"setdiff: {stop}", file=sys.stderr, everywhere=True)
        return stop.exit_code
    if int(os.environ.get("RANK", "0")) == 0:
        from setdiff_megatron.evaluation.showcase import showcase

        for line in showcase(recipe):
            say(line)
    return 0


def _load_checked(args: argparse.Namespace, *, launch: bool = False):
    """The recipe, refused in one line by `check_run`: for a launch, with its checkpoint
    directory and newest checkpoint too; a portable check assumes a GPU and reads no files."""
    from setdiff_megatron.recipes import load_recipe
    from setdiff_megatron.training.preflight import check_run

    recipe = load_recipe(args.recipe, args.overrides)
    portable = getattr(args, "portable", False)
    check_run(
        recipe,
        args.recipe,
        world_size=getattr(args, "world_size", None),
        has_gpu=True if portable else None,
        files=not portable,
        checkpoint_dir=launch,
        resumable=launch,
    )
    return recipe


def _recipe_show(args: argparse.Namespace) -> int:
    from setdiff_megatron.recipes import dump_recipe, load_recipe

    print(dump_recipe(load_recipe(args.recipe, args.overrides)), end="")
    return 0


def _recipe_validate(args: argparse.Namespace) -> int:
    recipe = _load_checked(args)
    p = recipe.parallel
    print(
        f"ok: {args.recipe} ({recipe.name}): engine {recipe.engine}, {recipe.launch.world_size} processes, "
        f"tp {p.tp} pp {p.pp}, global batch {p.global_batch_size} x {recipe.data.seq_len} tokens"
    )
    return 0


def _launch(args: argparse.Namespace) -> int:
    if getattr(args, "slurm", False):
        from setdiff_megatron.launch.slurm import launch_slurm

        return launch_slurm(args.recipe, args.overrides, dry_run=args.dry_run)
    from setdiff_megatron.launch.local_launch import launch_local

    dry_run = getattr(args, "dry_run", False)
    recipe = _load_checked(args, launch=not dry_run)
    _say_plan(recipe)
    if dry_run:
        return launch_local(recipe, args.recipe, args.overrides, dry_run=True)
    from setdiff_megatron.distributed.ownership import hold
    from setdiff_megatron.distributed.signals import supervise_launch

    hold(recipe.checkpoint.dir)  # before anything touches it; torchrun and the workers inherit it
    return supervise_launch(recipe.checkpoint.dir, lambda: launch_local(recipe, args.recipe, args.overrides))


def _say_plan(recipe) -> None:
    """The plan's one line for a GPU run, or its refusal (planning/launch_check.py)."""
    from setdiff_megatron.planning.launch_check import launch_plan

    summary = launch_plan(recipe)
    if summary:
        say(summary)


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    from setdiff_megatron.checkpoint.resolve import describe

    print("\n".join(describe(args.run_dir)))
    return 0


def _sample(args: argparse.Namespace) -> int:
    from setdiff_megatron.inference.cli_args import decoding_from_args, placement_from_args, relaunch
    from setdiff_megatron.inference.job import SampleJob, run_sample_job

    code = relaunch(args)
    if code is not None:
        return code
    run_sample_job(
        SampleJob(
            source=args.source,
            prompts=args.prompts,
            out=args.out,
            decoding=decoding_from_args(args),
            placement=placement_from_args(args),
            add_bos=args.add_bos,
            context_len=args.context_len,
            stop_at_eos=not args.ignore_eos,
        )
    )
    return 0


def _add_sample_parser(sub) -> None:
    from setdiff_megatron.inference.cli_args import add_decoding_arguments, add_job_arguments

    sample = sub.add_parser(
        "sample",
        help="decode a JSONL file of prompts with the cached set sampler",
        description='Decode prompts ({"prompt": text} or {"segments": [text, span length, text, ...]} per '
        "line) from a checkpoint (a run directory or step_* directory) or a Hugging Face export. Prompts are "
        "sharded over processes (--nproc, torchrun or a SLURM array via --shard/--num-shards) and the results "
        "merged into OUT in prompt order; a rerun skips prompts already written.",
    )
    add_job_arguments(sample)
    sample.add_argument("--prompts", required=True, help="JSONL file of prompts")
    sample.add_argument("--out", required=True, help="JSONL results, one per prompt, in prompt order")
    add_decoding_arguments(sample)
    sample.set_defaults(func=_sample)


def _convert_to_hf(args: argparse.Namespace) -> int:
    from setdiff_megatron.distributed.ownership import hold

    hold(args.out_dir)
    if args.layout == "setdlm":
        from setdiff_megatron.hf.release_export import export_release

        lines = export_release(args.checkpoint, args.out_dir, base_name=args.base_name, overwrite=args.overwrite)
        say("\n".join(f"setdiff: {line}" for line in lines))
        return 0
    from setdiff_megatron.hf.export import export_to_hf

    report = export_to_hf(
        args.checkpoint,
        args.out_dir,
        dtype=args.dtype,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
        check=args.check,
        tolerance=args.tolerance,
    )
    say("\n".join(f"setdiff: {line}" for line in report.lines))
    return 0


def _convert_from_hf(args: argparse.Namespace) -> int:
    from setdiff_megatron.distributed.ownership import hold
    from setdiff_megatron.hf.import_hf import import_from_hf

    hold(args.out_ckpt)
    report = import_from_hf(
        args.hf_dir,
        args.out_ckpt,
        dtype=args.dtype,
        overwrite=args.overwrite,
        check=args.check,
        tolerance=args.tolerance,
        base=args.base,
    )
    say("\n".join(f"setdiff: {line}" for line in report.lines))
    return 0


def _add_convert_parser(sub) -> None:
    convert = sub.add_parser(
        "convert",
        help="convert checkpoints to and from Hugging Face format",
        description="Both directions finish by comparing the logits of the source and the "
        "converted model on a fixed batch and print the largest difference.",
    )
    convert_sub = convert.add_subparsers(dest="convert_command", metavar="DIRECTION", required=True)
    to_hf = convert_sub.add_parser(
        "to-hf",
        help="export a checkpoint as a Hugging Face directory (trust_remote_code)",
        description="Export a megatron checkpoint (any TP/PP layout; a run directory "
        "takes its newest) as a directory that AutoModel.from_pretrained(dir, "
        "trust_remote_code=True) loads with only torch and transformers installed.",
    )
    to_hf.add_argument("checkpoint", help="run directory, checkpoints/ folder or step_* directory")
    to_hf.add_argument("out_dir", help="the Hugging Face directory to write")
    to_hf.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="weight precision (default: as saved)"
    )
    to_hf.add_argument("--shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    to_hf.add_argument(
        "--layout",
        default="setdiff",
        choices=["setdiff", "setdlm"],
        help="setdiff: our export (AutoModel, trust_remote_code); setdlm: the reference's release "
        "folder (pytorch_model.bin, SetDLM config; docs/huggingface.md)",
    )
    to_hf.add_argument(
        "--base-name",
        default=None,
        help="--layout setdlm, Qwen3 layout: the base model the release names, e.g. Qwen/Qwen3-1.7B-Base",
    )
    add_base_argument(to_hf)
    from_hf = convert_sub.add_parser(
        "from-hf",
        help="import a Llama/Qwen2/Qwen3/Qwen3-MoE model, an export or the "
        "reference's releases as a megatron checkpoint",
        description="Import a local "
        "Hugging Face directory (safetensors) of a Llama, Qwen2, Qwen3 or Qwen3-MoE causal "
        "LM, to adapt into a set diffusion model (model.init_from), one of our exports, "
        "a SetDLM release of the reference implementation (pytorch_model.bin, Qwen3 or "
        "DiT backbone; docs/huggingface.md) or its DiT (Hub directory or composer .pt, "
        "docs/dit.md), as a megatron checkpoint run directory, written in one process, "
        "that trains at any layout.",
    )
    from_hf.add_argument(
        "hf_dir",
        help="a local Hugging Face model directory or SetDLM release, or a composer .pt of the reference's DiT",
    )
    from_hf.add_argument("out_ckpt", help="the run directory to write (checkpoints/step_00000000 inside)")
    from_hf.add_argument(
        "--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="weight precision (default: the source's)"
    )
    add_base_argument(from_hf)
    for parser, handler in ((to_hf, _convert_to_hf), (from_hf, _convert_from_hf)):
        parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
        parser.add_argument(
            "--check",
            action="store_true",
            help="fail (exit code 2, nothing written) when the logits differ beyond the tolerance",
        )
        parser.add_argument(
            "--tolerance",
            type=float,
            default=None,
            help="largest |logit difference| --check "
            "accepts (default 1e-4, against the source rounded to the output precision)",
        )
        parser.set_defaults(func=handler)


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a YAML recipe, e.g. recipes/tiny-cpu.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="dotted overrides applied after the recipe, e.g. train.lr=3e-4 parallel.tp=2",
    )


def _add_train_parser(sub) -> None:
    train = sub.add_parser(
        "train",
        help="train a model from a recipe",
        description="Train from a YAML recipe. Started by hand with a recipe that asks for "
        "several processes, it launches them itself (as `setdiff launch` does). Exit code 75: "
        "stopped by SIGTERM/SIGUSR1 after writing a checkpoint; requeue to resume.",
    )
    _add_recipe_args(train)
    train.set_defaults(func=_train)


def _add_recipe_parser(sub) -> None:
    recipe = sub.add_parser(
        "recipe",
        help="print or check a recipe",
        description="Resolve a recipe (base: inheritance, overrides, ${env:...}) "
        "and print it, or check it against the schema and the cross-field rules.",
    )
    recipe_sub = recipe.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    show = recipe_sub.add_parser("show", help="print the fully resolved recipe as YAML")
    _add_recipe_args(show)
    show.set_defaults(func=_recipe_show)
    validate = recipe_sub.add_parser("validate", help="check a recipe; exit code 2 with one line if it is wrong")
    _add_recipe_args(validate)
    validate.add_argument(
        "--world-size", type=int, default=None, help="check against this many processes instead of the launch section's"
    )
    validate.add_argument(
        "--portable",
        action="store_true",
        help="check only the recipe itself: not its files on this machine, nor this machine's GPUs",
    )
    validate.set_defaults(func=_recipe_validate)


def _add_preprocess_parser(sub) -> None:
    # Listed for --help; `main` hands its arguments to the preprocessing tool's own parser.
    sub.add_parser("preprocess", add_help=False, help="tokenize corpora into megatron indexed datasets (.bin/.idx)")


def _add_launch_parser(sub) -> None:
    launch = sub.add_parser(
        "launch",
        help="start the processes of a recipe's launch section (torchrun, SLURM)",
        description="Validate a recipe, then start launch.nproc_per_node local processes "
        "with torchrun, each running `setdiff train RECIPE`; or, with --slurm, write an "
        "sbatch script for launch.nnodes x launch.nproc_per_node processes next to the run "
        "(checkpoint.dir) and submit it (see slurm/README.md).",
    )
    _add_recipe_args(launch)
    launch.add_argument(
        "--slurm",
        action="store_true",
        help="submit a SLURM job rendered from the recipe's launch section and the cluster file",
    )
    launch.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command (with --slurm: the sbatch script) instead of running it",
    )
    launch.set_defaults(func=_launch)


def _add_eval_parser(sub) -> None:
    from setdiff_megatron.evaluation.eval_cli import add_eval_parser

    add_eval_parser(sub)


def _add_serve_parser(sub) -> None:
    from setdiff_megatron.serving.serve_cli import add_parser

    add_parser(sub)


def _add_plan_parser(sub) -> None:
    from setdiff_megatron.planning.plan_cli import add_parser

    add_parser(sub, _add_recipe_args)


def _add_checkpoint_parser(sub) -> None:
    checkpoint = sub.add_parser("checkpoint", help="look at a run's checkpoints")
    checkpoint_sub = checkpoint.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    inspect = checkpoint_sub.add_parser(
        "inspect",
        help="step, validity, recipe, parallel layout and tokenizer of each checkpoint, and which one `latest` names",
    )
    inspect.add_argument("run_dir", help="a run's checkpoint.dir (or its checkpoints/ folder)")
    inspect.set_defaults(func=_checkpoint_inspect)


SUBCOMMANDS = {
    "train": _add_train_parser,
    "recipe": _add_recipe_parser,
    "preprocess": _add_preprocess_parser,
    "launch": _add_launch_parser,
    "sample": _add_sample_parser,
    "eval": _add_eval_parser,
    "serve": _add_serve_parser,
    "plan": _add_plan_parser,
    "convert": _add_convert_parser,
    "checkpoint": _add_checkpoint_parser,
}
"""Each subcommand's parser, in the order --help lists them."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole `setdiff` parser, or, given a subcommand's name, a parser of that subcommand
    alone: its options import what they name (the sampler's settings, the evaluation jobs), and
    `setdiff train` and each of its ranks need none of that (about 2 s a process on a CPU)."""
    parser = ArgumentParser(
        prog="setdiff",
        description="Train, sample and evaluate set diffusion language models.",
    )
    parser.add_argument("--version", action="version", version=f"setdiff-megatron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, add in SUBCOMMANDS.items():
        if command not in SUBCOMMANDS or command == name:
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preprocess"]:
        from setdiff_megatron.data.preprocess_cli import preprocess_main

        return preprocess_main(argv[1:])
    parser = build_parser(argv[0] if argv else None)
    # Overrides may follow options (`launch R --dry-run train.lr=1e-3`): argparse leaves them unknown.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not hasattr(args, "func"):
        parser.print_help()
        return 0
    args.argv = argv
    if getattr(args, "base", None):  # a Qwen3 release's base model, for this process and those it starts
        os.environ[BASE_ENV] = str(Path(args.base).absolute())
    from setdiff_megatron.distributed import child_processes, ownership

    child_processes.follow_parent()  # a worker or a started command ends with what started it
    try:
        return run_reporting(lambda: args.func(args))
    except KeyboardInterrupt:
        say("setdiff: interrupted", file=sys.stderr, everywhere=True)
        return 130
    finally:
        ownership.release_all()


if __name__ == "__main__":
    sys.exit(main())
