"""`python -m benchmarks.study [--setting supervised|packed|adapted|infill|budget] [--seeds 1,2,3]
[--quick]`: train the study's models, evaluate them, report. `--report-only` draws results.md and
the plots again from the setting's existing results.json, training and evaluating nothing;
`--claims` writes the table of the paper's claims from every setting's results.json; `--merge`
decodes the models of `--models` into the setting's existing results.json.

See benchmarks/study/__init__.py for what is measured and docs/study.md for how long each setting
takes. --quick trains set diffusion d = 4 of the setting as the full run trains it and decodes it
at W = 1 and at the paper's default policy: under 8 minutes for the adapted setting (the one
tests/benchmarks/study/test_quick.py holds to its seeds' spread), under 15 for the supervised one.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.machine import RESULTS_DIR, machine_info
from benchmarks.study import claims, plan, report, run, unconditional
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.recipes import load_recipe


def _budgets(text: str) -> tuple[int, ...]:
    """--budgets: positive step counts, e.g. 400,1600,6400."""
    try:
        budgets = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        budgets = ()
    if not budgets or min(budgets) < 1 or len(set(budgets)) != len(budgets):
        raise argparse.ArgumentTypeError(
            f"expected distinct positive step counts separated by commas, e.g. 400,1600,6400; got {text!r}"
        )
    return budgets


def _model_entry(out: Path, model: plan.Model, steps: int | None) -> dict:
    recipe = load_recipe(model.recipe, run.overrides(out, model, steps))
    return {
        "label": model.label,
        "family": model.family,
        "recipe": str(model.recipe.relative_to(plan.RECIPES.parents[1])),
        "steps": recipe.train.steps,
        "seed": recipe.train.seed,
        "train_minutes": run.train_minutes(out, model),
        "valid_curve": run.valid_curve(out, model),
    }


def _points(rows: list[dict]) -> list[dict]:
    return [
        {
            "invocation": r["invocation"],
            "point": r["point"],
            "window": r["decoding"]["window"],
            "threshold": r["decoding"]["threshold"],
            "block_size": r["decoding"]["block_size"],
            # A point scored before the setting existed was decoded aligned.
            "align_inputs_to_blocks": r["decoding"].get("align_inputs_to_blocks", True),
            "accuracy": r["score"],
            "tokens_per_step": r["tokens_per_step"],
            "tokens_per_s": r["tokens_per_s"],
            "mean_nfe": r["mean_nfe"],
            "examples": r["num_examples"],
            "levels": report.level_accuracy(Path(r["dir"])),
        }
        for r in rows
    ]


def _report_only(parser: argparse.ArgumentParser, args: argparse.Namespace, results_dir: Path) -> dict:
    """--report-only: the report of an existing results.json, drawn again by the code that first drew
    it (report.render), e.g. after a change to the report or to the models' names and labels."""
    if ignored := _ignored(args):
        parser.error(f"--report-only trains and evaluates nothing; drop {', '.join(ignored)}")
    path = results_dir / "results.json"
    if not path.is_file():
        parser.error(f"--report-only: no {path}; run the study without --report-only first, or name --results")
    results = json.loads(path.read_text(encoding="utf-8"))
    report.render(results, results_dir)
    print(f"study: results.md and plots drawn again from {path}", flush=True)
    return results


def _claims(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """--claims: the claims table from every setting's results.json under --results (default
    benchmarks/results/study), written beside them as claims.md."""
    if ignored := _ignored(args):
        parser.error(f"--claims trains and evaluates nothing; drop {', '.join(ignored)}")
    root = args.results or RESULTS_DIR / "study"
    if not root.is_dir():
        parser.error(f"--claims: no folder {root}; name the folder of the settings' results with --results")
    by_setting = {
        s: json.loads((root / s / "results.json").read_text(encoding="utf-8"))
        for s in plan.SETTINGS
        if (root / s / "results.json").is_file()
    }
    text = claims.claims_markdown(by_setting)
    (root / "claims.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"study: the claims table of {', '.join(by_setting) or 'no setting'} in {root / 'claims.md'}", flush=True)
    return by_setting


def _invocation_record(started: str, invocation: str, load_start: float, start: float, argv: list[str] | None) -> dict:
    """When this invocation ran, how long, under what load, and its command line."""
    return {
        "started": started,
        "invocation": invocation,
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "wall_minutes": (time.perf_counter() - start) / 60,
        "command": "python -m benchmarks.study" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:])),
    }


def _merged(results_dir: Path, args: argparse.Namespace, models: dict, record: dict) -> dict:
    """--merge: the setting's results.json with `models`' entries put in (replacing theirs), and
    this invocation recorded under "merges" beside the one that made the file."""
    path = results_dir / "results.json"
    if not path.is_file():
        raise SystemExit(f"study: --merge: no {path} to merge into; run the setting first")
    results = json.loads(path.read_text(encoding="utf-8"))
    if results["setting"] != args.setting or results["seeds"]["training"] != (
        args.seeds or results["seeds"]["training"]
    ):
        raise SystemExit(
            f"study: --merge: {path} holds the {results['setting']} setting over seeds {results['seeds']['training']}; "
            "merge the same setting and seeds"
        )
    results["models"] |= models
    results.setdefault("merges", []).append({"models": list(models), **record})
    return results


RUN_FILES = "runs"
"""--per-run: each run's figures, RESULTS/runs/<run key>.json."""


def _commit() -> str:
    """The checkout's commit, with "+changes" when its tracked files differ from it."""
    git = ["git", "-C", str(plan.RECIPES.parents[1])]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True).returncode != 0
    except FileNotFoundError:  # no git on this machine: the run file says so rather than failing the run
        return "unknown (no git)"
    return (head or "unknown") + ("+changes" if head and dirty else "")


def _write_run_file(results_dir: Path, model: plan.Model, entry: dict, invocation: str) -> None:
    """One run's figures as it finishes: its model's entry (training, validation curve, every decoding
    point with each problem's score), the group it belongs to, the code's commit and the invocation
    that decoded it (its load average at the end: the speeds' conditions)."""
    record = entry | {
        "group": model.group,
        "commit": _commit(),
        "invocation": invocation,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_end": os.getloadavg()[0],
        "machine": machine_info(),
    }
    path = results_dir / RUN_FILES / f"{model.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    print(f"study: {model.key}'s figures in {path}", flush=True)


def _models_from_run_files(results_dir: Path, *, seeded: bool) -> dict[str, dict]:
    """Every run file under RESULTS/runs as the setting's model entries: a group's runs over their
    seeds (report.over_seeds, whatever invocations and commits decoded them: each run names
    its own), or its one run."""
    groups: dict[str, dict] = {}
    for path in sorted((results_dir / RUN_FILES).glob("*.json")):
        entry = json.loads(path.read_text(encoding="utf-8"))
        groups.setdefault(entry["group"], {})[entry["seed"] if seeded else None] = entry
    return {
        group: report.over_seeds(dict(sorted(runs.items()))) if seeded else runs[None] for group, runs in groups.items()
    }


def _with_run_files(results_dir: Path, args: argparse.Namespace, models: dict, record: dict, facts: dict) -> dict:
    """--per-run: the setting's results.json with the run files' entries put in (an earlier whole
    invocation's other models kept as measured), this invocation recorded under "per_run"; a new one
    takes this invocation's facts of the task."""
    path = results_dir / "results.json"
    if path.is_file():
        results = json.loads(path.read_text(encoding="utf-8"))
        if results["setting"] != args.setting:
            raise SystemExit(f"study: --per-run: {path} holds the {results['setting']} setting; name --results")
    else:
        results = {"mode": "full", "setting": args.setting, **record, "machine": machine_info(), **facts}
        results["code_models"] = {}
    seeds = results.setdefault("seeds", _seeds(args))
    if isinstance(seeds["training"], list) and args.seeds:  # the seeds any run of the setting trained
        seeds["training"] = sorted(set(seeds["training"]) | set(args.seeds))
    results["models"] = results.get("models", {}) | models
    if args.setting == "budget":
        results["budgets"] = sorted(set(results.get("budgets", [])) | set(args.budgets or plan.BUDGETS))
    results.setdefault("per_run", []).append({"models": list(models), **record})
    return results


def _seeds(args: argparse.Namespace) -> dict:
    """The seeds of a setting's results: the corpus's, training's and decoding's."""
    decoding = "greedy" if args.setting != "unconditional" else unconditional.SAMPLING
    return {"corpus": 0, "training": args.seeds or "recipe train.seed (1234)", "decoding": decoding}


def _ignored(args: argparse.Namespace) -> list[str]:
    """Flags that train or evaluate, given to a mode that does neither."""
    return [
        f"--{f.replace('_', '-')}"
        for f in ("out", "steps", "seeds", "models", "budgets", "train_only")
        if getattr(args, f)
    ]


def _parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting",
        choices=plan.SETTINGS,
        default="supervised",
        help="supervised records (the paper's format; default), packed pretraining windows, adapted from the "
        "AR base, infill (chains the right side decides), budget (the adapted headline models at --budgets), or "
        "unconditional (samples of models pretrained on packed windows, judged by a longer-trained AR model)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="set diffusion d = 4 of the setting (supervised or adapted) only, at W = 1 and W = 4, threshold 0.9",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="runs and evaluations (default runs/study/SETTING, the budget setting's runs/study/adapted, or "
        "runs/study-quick/SETTING)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="tables and plots (default benchmarks/results/study/SETTING, or .../study-quick/SETTING; with "
        "--claims, the folder of the settings' folders, default benchmarks/results/study)",
    )
    parser.add_argument("--per-level", type=int, default=50, help="test problems per difficulty level (default 50)")
    parser.add_argument(
        "--infill-per-level", type=int, default=200, help="infill setting: chains per level to infill (default 200)"
    )
    parser.add_argument("--code-examples", type=int, default=200, help="stdlib function bodies to infill")
    parser.add_argument(
        "--samples",
        type=int,
        default=unconditional.SAMPLES,
        help=f"unconditional setting: samples per decoding point (default {unconditional.SAMPLES})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train every model this many steps instead of "
        "its recipe's (a smoke run of the pipeline; the figures mean nothing then)",
    )
    parser.add_argument(
        "--seeds",
        type=plan.parse_seeds,
        default=None,
        help="train every model once per training seed (train.seed), e.g. 1,2,3, and report the mean "
        "and spread over them; default: one run at the recipe's seed",
    )
    parser.add_argument(
        "--budgets",
        type=_budgets,
        default=None,
        help="budget setting: the adaptation steps to train each headline model for (default "
        f"{','.join(map(str, plan.BUDGETS))}; {plan.ADAPTED_STEPS} reuses the adapted setting's runs)",
    )
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated subset of the setting's models ({', '.join(m.name for m in plan.REASONING_MODELS)})",
    )
    parser.add_argument(
        "--train-only",
        action="store_true",
        help="train the models that are not trained yet and stop: a long setting can train over several "
        "sessions, then decode every model in one invocation, so that its speeds are measured together",
    )
    parser.add_argument(
        "--per-run",
        action="store_true",
        help="train and decode one run (a model at one seed) at a time, writing its figures to "
        "RESULTS/runs/<run>.json as it finishes, with the code's commit; then the setting's results.json "
        "from every run file there: a setting too long for one sitting is finished in pieces, each "
        "run's file committed as it comes",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="with --models: put those models' entries into the results.json already in --results, "
        "keeping the others as they were measured (each figure names its invocation), e.g. to "
        "decode the baselines again under another protocol without training every model again",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train and evaluate nothing: draw results.md and the plots again from the results.json "
        "already in --results (default that of --setting, or of --quick)",
    )
    parser.add_argument(
        "--claims",
        action="store_true",
        help="train and evaluate nothing: write the table of the paper's claims (claims.md) from every "
        "setting's results.json",
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    for flag in ("per_level", "infill_per_level", "code_examples", "samples", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1; got {value}")
    if args.quick and args.setting not in ("supervised", "adapted"):
        parser.error("--quick runs the supervised or the adapted setting")
    if args.budgets and args.setting != "budget":
        parser.error("--budgets belongs to --setting budget")
    if args.merge and (not args.models or args.train_only or args.report_only or args.claims):
        parser.error("--merge needs --models (the entries it replaces) and trains and evaluates them")
    if args.per_run and args.setting == "packed":
        parser.error("--per-run: the packed setting's code models are trained and scored with the whole setting")
    if args.per_run and (args.merge or args.train_only or args.report_only or args.claims or args.quick):
        parser.error(
            "--per-run trains and decodes each run and writes the setting's results from the run files; "
            "drop --merge, --train-only, --report-only, --claims and --quick"
        )
    if args.claims:
        return _claims(parser, args)
    quick = "study-quick" if args.quick else "study"
    # The budget setting's runs are adapted models: its 400-step ones are the adapted setting's.
    out = (args.out or Path("runs") / quick / ("adapted" if args.setting == "budget" else args.setting)).resolve()
    results_dir = args.results or RESULTS_DIR / quick / args.setting
    if args.report_only:
        return _report_only(parser, args, results_dir)
    start, started, invocation = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M %Z"), run.new_invocation(out)
    load_start = os.getloadavg()[0]
    budgets = args.budgets or plan.BUDGETS
    reasoning, code = plan.models(args.quick, args.setting, budgets)
    if args.models:
        wanted, names = args.models.split(","), list(dict.fromkeys(m.name for m in reasoning))
        if unknown := sorted(set(wanted) - set(names)):
            parser.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
        reasoning = [m for m in reasoning if m.name in wanted]
    seeded = [[replace(m, seed=s) for s in args.seeds] if args.seeds else [m] for m in reasoning]

    for m in [] if args.per_run else [*(r for runs in seeded for r in runs), *code]:
        run.train(out, m, args.steps)
    if args.train_only:
        print(
            f"study: {sum(map(len, seeded)) + len(code)} runs trained in {out / 'runs'}; evaluated nothing", flush=True
        )
        return {"trained": [m.key for runs in seeded for m in runs] + [m.key for m in code]}
    if args.setting == "infill":
        task, baselines = run.prepare_infill_task(out, args.infill_per_level)

        def evaluate(m: plan.Model) -> dict:
            infills = {
                "_".join(filter(None, ("infill_chains", variant))): run.infill(out, m, "jsonl", task, None, variant)
                for variant in m.infills()
            }
            return infills | {"points": []}

        facts = {"infill_per_level": args.infill_per_level, "infill_baselines": baselines}
    elif args.setting == "unconditional":

        def evaluate(m: plan.Model) -> dict:
            return {"points": [], "generation": unconditional.generation(out, m, args.samples)}

        judge = unconditional.JUDGE
        _, _, docs = run.prepare_tasks(out, args.per_level)
        facts = {
            "samples": args.samples,
            "judge": {"label": judge.label, "recipe": str(judge.recipe.relative_to(plan.RECIPES.parents[1]))},
            "reference": unconditional.reference(out, docs, args.samples, args.steps),
        }
    else:
        corpus, tasks, docs = run.prepare_tasks(out, args.per_level)

        def evaluate(m: plan.Model) -> dict:
            entry = {}
            if args.setting == "packed":  # whole-document models: likelihood and infilling
                entry |= run.likelihood(out, m, docs)
                entry["infill_jsonl"] = run.infill(out, m, "jsonl", corpus.infill_tasks, None)
            rows = run.sweep(out, m, tasks, args.quick)
            points = _points(rows)
            if args.per_run:  # a run file keeps every problem's score, for paired comparisons later
                for point, row in zip(points, rows):
                    point["per_problem"] = report.per_problem(Path(row["dir"]))
            return entry | {"points": points}

        facts = {
            "test_problems": sum(1 for _ in tasks.open()),
            "per_level": args.per_level,
            "trivial_baseline": run.trivial_baseline(tasks),
            **({"budgets": list(budgets)} if args.setting == "budget" else {}),
        }
    models = {}
    if args.per_run:
        for m in (r for runs in seeded for r in runs):
            run.train(out, m, args.steps)
            _write_run_file(results_dir, m, _model_entry(out, m, args.steps) | evaluate(m), invocation)
        models = _models_from_run_files(results_dir, seeded=bool(args.seeds))
    for runs in [] if args.per_run else seeded:
        entries = {m.seed: _model_entry(out, m, args.steps) | evaluate(m) for m in runs}
        models[runs[0].group] = report.over_seeds(entries) if args.seeds else entries[None]
    code_models = {}
    for m in code:
        code_models[m.name] = _model_entry(out, m, args.steps) | {
            "infill_code": run.infill(out, m, "code", None, args.code_examples),
            "points": [],
        }

    record = _invocation_record(started, invocation, load_start, start, argv)
    if args.merge:
        results = _merged(results_dir, args, models, record)
        report.write(results, results_dir)
        print(report.markdown(results))
        print(f"study: {', '.join(models)} merged into {results_dir}", flush=True)
        return results
    if args.per_run:
        results = _with_run_files(results_dir, args, models, record, facts)
        report.write(results, results_dir)
        print(report.markdown(results))
        print(f"study: {', '.join(models)} from the run files of {results_dir / RUN_FILES}", flush=True)
        return results
    results = {
        "mode": "quick" if args.quick else "full",
        "setting": args.setting,
        **record,
        "machine": machine_info(),
        "seeds": _seeds(args),
        **facts,
        "models": models,
        "code_models": code_models,
    }
    report.write(results, results_dir)
    print(report.markdown(results))
    print(f"study: results in {results_dir}", flush=True)
    return results


if __name__ == "__main__":
    main()
