"""Evidence for RL with exact trajectory likelihoods (docs/rl.md): GRPO from the main job's model
on the training problems, three ways, over training seeds, every model measured the same way.

    python -m benchmarks.rl [--base runs/tiny-reasoning] [--seeds 1,2,3] [--steps 200]
                            [--out runs/rl-study] [--results benchmarks/results/rl]

The variants share recipes/rl-reasoning.yaml and its budget (--steps optimizer steps of 8 prompts
x 4 completions):
- exact: the exact trajectory likelihood (rl.likelihood exact), every weight trained;
- one_step: diffu-GRPO's one-step estimate of the likelihood, the rest alike;
- lora: the exact likelihood, LoRA adapters (rank 8 on every linear layer) trained alone.

Each run is `setdiff train recipes/rl-reasoning.yaml` in its own process under OUT/runs, named by
its variant, steps, learning rate and seed (a run whose final checkpoint is in place is reused); the base and every run are then scored by the
`setdiff eval generate` job on the study's 1,000 held-out problems (200 of each training level) at
the model's own decoding policy and at one token per step (window 1): accuracy, tokens per step,
tokens/s. Training cost comes from each run's metrics.jsonl: wall seconds per RL step (rollouts
included), the update's tokens/s, each rank's peak resident memory, and the parameters the
optimizer holds (its checkpoint's state). Run it on quiet cores: the speeds share them.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.machine import RESULTS_DIR, machine_info
from benchmarks.study import run as study_run
from benchmarks.study.plan import parse_seeds
from benchmarks.study.report import over_seed_values
from setdiff_megatron.checkpoint.names import CHECKPOINTS, find_checkpoints
from setdiff_megatron.distributed.child_processes import child_env
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.evaluation.tasks import SCORED, GenerateJob, run_generate_job
from setdiff_megatron.recipes import load_recipe

RECIPE = study_run.ROOT / "recipes" / "rl-reasoning.yaml"
VARIANTS: dict[str, tuple[str, ...]] = {
    "exact": (),
    "one_step": ("rl.likelihood=one_step",),
    "lora": ("model.lora.rank=8", "model.lora.alpha=16", "train.lr={lora_lr}", "train.min_lr={lora_lr}"),
}
"""Overrides of each variant over the shared ones (`_overrides`)."""
POLICIES = {"policy": {}, "one_token_per_step": {"window": 1, "threshold": None}}
"""The decodings every model is scored at: its own policy, and left to right one token a step."""


def _run_dir(args, variant: str, seed: int) -> Path:
    """A run's directory, named by what it trains with: a run is reused only under the same
    settings (another --steps or learning rate trains anew beside it)."""
    lr = args.lora_lr if variant == "lora" else args.lr
    return args.out / "runs" / f"{variant}-steps{args.steps}-lr{lr:g}-seed{seed}"


def _overrides(args, variant: str, seed: int) -> list[str]:
    shared = [
        f"model.init_from={args.base}",
        f"checkpoint.dir={_run_dir(args, variant, seed)}",
        f"data.cache_dir={args.out / 'data'}",
        f"train.seed={seed}",
        f"train.steps={args.steps}",
        f"train.lr={args.lr}",
        f"train.min_lr={args.lr}",
        f"checkpoint.interval={args.steps}",
        f"eval.interval={args.steps}",
        "eval.showcase_problems=0",
        "log.interval=1",
    ]
    return shared + [o.format(lora_lr=args.lora_lr) for o in VARIANTS[variant]]


def _train(args, variant: str, seed: int) -> Path:
    """The run's directory, trained unless its final checkpoint is in place."""
    directory = _run_dir(args, variant, seed)
    if any(c.name == f"step_{args.steps:08d}" for c in find_checkpoints(directory / CHECKPOINTS)):
        print(f"rl: {directory.name} is trained", flush=True)
        return directory
    log = args.out / "logs" / f"{directory.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "setdiff_megatron.cli", "train", str(RECIPE), *_overrides(args, variant, seed)]
    print(f"rl: training {directory.name} (log {log})", flush=True)
    with open(log, "ab") as stream:
        code = subprocess.call(cmd, stdout=stream, stderr=subprocess.STDOUT, cwd=study_run.ROOT, env=child_env())
    if code != 0:
        raise SystemExit(f"rl: training {directory.name} failed with exit code {code}; see {log}")
    return directory


def _evaluate(args, source: Path, name: str, tasks: Path) -> dict:
    """Accuracy, tokens per step and tokens/s at each of POLICIES (`setdiff eval generate`'s job)."""
    scores = {}
    for policy, settings in POLICIES.items():
        metrics = run_generate_job(
            GenerateJob(
                source=str(source),
                tasks=str(tasks),
                out=str(args.out / "eval" / name / policy),
                metric="gsm8k",
                decoding={"max_new_tokens": study_run.MAX_NEW_TOKENS, **settings},
                placement=study_run.PLACEMENT,
            )
        )
        scores[policy] = {k: metrics[k] for k in ("score", "tokens_per_step", "tokens_per_s", "num_examples")}
    return scores


def _training_cost(directory: Path) -> dict:
    """What the run spent: wall seconds per RL step (rollouts, replay and update), the update's
    tokens/s (median), the ranks' peak resident memory, the parameters the optimizer holds, the
    final checkpoint's bytes; and its rollouts' figures step by step."""
    import torch.distributed.checkpoint as dcp

    rows = [json.loads(line) for line in (directory / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rl/reward" in r]
    final = find_checkpoints(directory / CHECKPOINTS)[-1]
    state = dcp.FileSystemReader(str(final)).read_metadata().state_dict_metadata
    trained = sum(v.size.numel() for k, v in state.items() if k.startswith("optimizer.state.exp_avg."))
    return {
        "seconds_per_step": statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:])),
        "update_tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in steps),
        "peak_memory_gb": max(r["perf/memory_gb"] for r in steps),
        "trained_parameters": trained,
        "checkpoint_mb": sum(f.stat().st_size for f in final.rglob("*") if f.is_file()) / 2**20,
        "curve": {k: [r[k] for r in steps] for k in ("rl/reward", "rl/accuracy", "rl/tokens_per_step", "rl/kl")},
    }


def _correct(args, name: str, policy: str) -> list[float]:
    """Each held-out problem's accuracy (0 or 1) in the order of the task file."""
    scored = args.out / "eval" / name / policy / SCORED
    records = sorted((json.loads(line) for line in scored.read_text().splitlines()), key=lambda r: r["index"])
    return [r["accuracy"] for r in records]


def paired_change(before: list[float], after_by_seed: list[list[float]]) -> dict:
    """The change in accuracy from `before`, problem by problem (the seeds' mean after, minus
    before), with its standard error over the problems: the same problems score both, so their
    difficulty cancels and this error is below either accuracy's own."""
    diffs = [statistics.fmean(seeds) - b for b, *seeds in zip(before, *after_by_seed)]
    return {"mean": statistics.fmean(diffs), "se_problems": statistics.stdev(diffs) / len(diffs) ** 0.5}


def _summary(runs: dict[int, dict], problems: int) -> dict:
    """A variant over seeds: each figure's mean and spread (study report's over_seed_values)."""
    first = next(iter(runs.values()))
    after = {
        policy: {
            "accuracy": over_seed_values([r["after"][policy]["score"] for r in runs.values()], problems),
            **{
                k: statistics.fmean(r["after"][policy][k] for r in runs.values())
                for k in ("tokens_per_step", "tokens_per_s")
            },
        }
        for policy in first["after"]
    }
    cost = {k: statistics.fmean(r["cost"][k] for r in runs.values()) for k in first["cost"] if k != "curve"}
    return {"after": after, "cost": cost, "by_seed": runs}


def _change(variant: dict, policy: str) -> str:
    c = variant["change"][policy]
    return f"{c['mean']:+.3f} ± {c['se_problems']:.3f}"


def markdown(results: dict) -> str:
    """The results as tables: held-out accuracy before and after, and what training cost."""
    base, problems = results["base"], results["problems"]
    lines = [
        "# RL from the main job's model (GRPO, recipes/rl-reasoning.yaml)",
        "",
        f"Seeds {', '.join(map(str, results['seeds']))}; {results['steps']} steps of "
        f"{results['completions_per_step']} completions; lr {results['lr']} (LoRA {results['lora_lr']}); "
        f"{problems} held-out problems; `{results['command']}`; started {results['started']}, load average "
        f"{results['load_average']['start']:.1f} to {results['load_average']['end']:.1f}.",
        "",
        "| model | accuracy at its policy | change | tokens/step | tokens/s | accuracy one token/step | change |",
        "|---|---|---|---|---|---|---|",
        f"| before (the main job's model) | {base['policy']['score']:.3f} | | {base['policy']['tokens_per_step']:.2f} "
        f"| {base['policy']['tokens_per_s']:.0f} | {base['one_token_per_step']['score']:.3f} | |",
    ]
    for name, v in results["variants"].items():
        p, w1 = v["after"]["policy"], v["after"]["one_token_per_step"]
        lines.append(
            f"| {name} | {p['accuracy']['mean']:.3f} ± {p['accuracy']['std']:.3f} | {_change(v, 'policy')} "
            f"| {p['tokens_per_step']:.2f} | {p['tokens_per_s']:.0f} | {w1['accuracy']['mean']:.3f} ± "
            f"{w1['accuracy']['std']:.3f} | {_change(v, 'one_token_per_step')} |"
        )
    lines += [
        "",
        "Accuracy: mean ± standard deviation over the seeds (the standard error from the problems is "
        f"about {(0.25 / problems) ** 0.5:.3f}); change: the seeds' mean minus before, problem by problem, ± its "
        "standard error over the problems (paired: the same problems score every model). Tokens/s: decoding "
        "the held-out problems, each model in turn on shared cores (about ±10 % between repeats; a LoRA run "
        "decodes with its adapters merged, the full model's shapes).",
        "",
        "| variant | s per RL step | update tokens/s | peak memory per rank (GB) | trained parameters "
        "| checkpoint (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in results["variants"].items():
        c = v["cost"]
        lines.append(
            f"| {name} | {c['seconds_per_step']:.2f} | {c['update_tokens_per_s']:.0f} | {c['peak_memory_gb']:.2f} "
            f"| {c['trained_parameters']:,.0f} | {c['checkpoint_mb']:.1f} |"
        )
    lines.append("")
    lines.append("Per seed, accuracy at the policy after RL:")
    for name, v in results["variants"].items():
        figures = ", ".join(f"{s}: {r['after']['policy']['score']:.3f}" for s, r in v["by_seed"].items())
        lines.append(f"- {name}: {figures}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Held-out accuracy against tokens per step before and after (seeds' spread as bars), and
    each variant's training reward over steps (mean over seeds)."""
    from benchmarks.study.plots import _plt, _save

    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    base = results["base"]["policy"]
    left.plot(base["tokens_per_step"], base["score"], "ko", label="before")
    for (name, v), colour in zip(results["variants"].items(), ("tab:blue", "tab:red", "tab:green")):
        p = v["after"]["policy"]
        xs = [r["after"]["policy"]["tokens_per_step"] for r in v["by_seed"].values()]
        left.errorbar(p["tokens_per_step"], p["accuracy"]["mean"], yerr=p["accuracy"]["std"],
                      xerr=statistics.stdev(xs) if len(xs) > 1 else 0, fmt="s", color=colour, label=name)  # fmt: skip
        curves = [r["cost"]["curve"]["rl/reward"] for r in v["by_seed"].values()]
        mean = [statistics.fmean(c) for c in zip(*curves)]
        window = max(1, len(mean) // 20)
        smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(len(mean))]
        right.plot(range(1, len(smooth) + 1), smooth, color=colour, label=name)
    left.set(xlabel="tokens per step", ylabel="held-out accuracy", title="At the model's policy")
    right.set(xlabel="RL step", ylabel=f"reward (mean over seeds, moving mean of {window})", title="Training")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=Path("runs/tiny-reasoning"), help="the main job's run")
    parser.add_argument("--seeds", type=parse_seeds, default=[1, 2, 3], help="training seeds, e.g. 1,2,3")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps a run")
    parser.add_argument("--lr", type=float, default=2e-5, help="the full fine-tunes' learning rate")
    parser.add_argument("--lora-lr", type=float, default=2e-4, help="the adapters' learning rate")
    parser.add_argument("--per-level", type=int, default=200, help="held-out problems of each training level")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=Path("runs/rl-study"), help="runs, data and evaluations")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR / "rl", help="results.json, .md and .png")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (seconds per step are measured between steps); got {args.steps}")
    if not (args.base / CHECKPOINTS).is_dir():
        parser.error(f"--base {args.base} holds no checkpoints: run `setdiff train recipes/tiny-reasoning.yaml` first")
    args.base, args.out = args.base.resolve(), args.out.resolve()
    rl = load_recipe(RECIPE, [f"model.init_from={args.base}"]).rl
    started, load_start = time.strftime("%Y-%m-%d %H:%M %Z"), os.getloadavg()[0]
    runs = {v: {s: _train(args, v, s) for s in args.seeds} for v in variants}
    _, tasks, _ = study_run.prepare_tasks(args.out, args.per_level)
    problems = sum(1 for _ in tasks.open())
    results = {
        "command": "python -m benchmarks.rl" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:])),
        "started": started,
        "machine": machine_info(),
        "seeds": args.seeds,
        "steps": args.steps,
        "lr": args.lr,
        "lora_lr": args.lora_lr,
        "completions_per_step": rl.prompts_per_step * rl.group_size,
        "problems": problems,
        "base": _evaluate(args, args.base, "base", tasks),
        "variants": {},
    }
    for variant, by_seed in runs.items():
        entries = {
            seed: {"after": _evaluate(args, d, d.name, tasks), "cost": _training_cost(d)} for seed, d in by_seed.items()
        }
        results["variants"][variant] = _summary(entries, problems) | {
            "change": {
                policy: paired_change(
                    _correct(args, "base", policy), [_correct(args, d.name, policy) for d in by_seed.values()]
                )
                for policy in POLICIES
            }
        }
    results["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.results / "results.md").write_text(markdown(results))
    plot(results, args.results / "rl.png")
    print(markdown(results))
    print(f"rl: results in {args.results}", flush=True)
    return results


if __name__ == "__main__":
    main()
