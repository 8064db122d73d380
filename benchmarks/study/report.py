"""The study's results: one JSON, markdown tables, and the plots (plots.py)."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.study import claims
from benchmarks.study.plots import JUDGE_PERPLEXITY, plot_curves, plot_infill, plot_pareto


def level_accuracy(point_dir: Path) -> dict[str, float]:
    """Accuracy per difficulty level of one sweep point (its scored.jsonl carries each task's level)."""
    hits: dict[str, list[float]] = defaultdict(list)
    for line in (point_dir / "scored.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        hits[record["level"]].append(record["accuracy"])
    return {level: sum(v) / len(v) for level, v in sorted(hits.items())}


def per_problem(point_dir: Path) -> list[float]:
    """Each test problem's score at one sweep point, in the task file's order."""
    lines = (point_dir / "scored.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["accuracy"] for line in lines]


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def over_seed_values(values: list[float], examples: int) -> dict:
    """A figure over seeds: the mean, the seeds' standard deviation, the standard error of the
    mean from the seed spread, and the standard error from the examples (binomial: the same
    examples serve every seed, so the spread over seeds does not contain it)."""
    mean, std = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "mean": mean,
        "std": std,
        "se_seeds": std / math.sqrt(len(values)),
        "se_problems": math.sqrt(max(mean * (1 - mean), 0.0) / examples),
    }


def _invocations(runs: list[dict]) -> dict:
    """Which invocation measured each seed's speeds, where recorded (run.invocation_of)."""
    return {"invocation_by_seed": [r["invocation"] for r in runs]} if "invocation" in runs[0] else {}


def over_seeds(entries: dict[int, dict]) -> dict:
    """One model's runs over training seeds as one entry. Each point's accuracy is the mean over
    seeds, with the seeds' standard deviation, the standard error of that mean from the seed spread,
    and the standard error from the test problems (`over_seed_values`); speeds and per-level accuracies
    are means, the validation curve the mean at the steps every run logged; infilling likewise
    (exact match and ROUGE with their spreads). `by_seed` keeps each run's figures."""
    runs = list(entries.values())
    points = []
    for p in runs[0]["points"]:
        same = [next(q for q in r["points"] if q["point"] == p["point"]) for r in runs]
        acc = [q["accuracy"] for q in same]
        stats = over_seed_values(acc, p["examples"])
        levels = {lv: _mean([q["levels"].get(lv) for q in same]) for lv in p["levels"]}
        points.append(
            {k: v for k, v in p.items() if k not in ("invocation", "per_problem")}
            | {
                "accuracy": stats["mean"],
                "accuracy_std": stats["std"],
                "accuracy_se_seeds": stats["se_seeds"],
                "accuracy_se_problems": stats["se_problems"],
                "accuracy_by_seed": acc,
                "tokens_per_step": _mean([q["tokens_per_step"] for q in same]),
                "tokens_per_s": _mean([q["tokens_per_s"] for q in same]),
                "mean_nfe": _mean([q["mean_nfe"] for q in same]),
                "tokens_per_step_by_seed": [q["tokens_per_step"] for q in same],
                "levels": levels,
            }
            | {"tokens_per_s_by_seed": [q["tokens_per_s"] for q in same]}
            | _invocations(same)
        )
    curves = [dict(r["valid_curve"]) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    infills = [k for k in runs[0] if k.startswith("infill_chains")]
    generated = ["generation"] if "generation" in runs[0] else []
    kept = ("train_minutes", "valid_curve", "points", *infills, *generated)
    return (
        {k: runs[0][k] for k in ("label", "family", "recipe", "steps")}
        | {
            "seeds": list(entries),
            "train_minutes": sum(r["train_minutes"] for r in runs),
            "valid_curve": [(s, statistics.fmean(c[s] for c in curves)) for s in steps],
            "points": points,
        }
        | {k: _infill_over_seeds([r[k] for r in runs]) for k in infills}
        | {k: _generation_over_seeds([r[k] for r in runs]) for k in generated}
        | {"by_seed": {str(seed): {k: r[k] for k in kept} for seed, r in entries.items()}}
    )


INFILL_SCORES = ("exact_match", "rouge1", "rouge2", "rougeL")


def _infill_over_seeds(runs: list[dict]) -> dict:
    """One model's infilling over seeds: each score's mean, spread and standard errors (exact
    match's binomial one from the examples), speeds and per-level exact match as means."""
    first, out = runs[0], {}
    for key in INFILL_SCORES:
        values = [r[key] for r in runs]
        stats = over_seed_values(values, first["examples"])
        out |= {key: stats["mean"], f"{key}_std": stats["std"], f"{key}_se_seeds": stats["se_seeds"]}
        out |= {f"{key}_by_seed": values} | (
            {"exact_match_se_problems": stats["se_problems"]} if key == "exact_match" else {}
        )
    return (
        {k: first[k] for k in ("task", "context", "examples", "skipped_too_long", "decoding")}
        | out
        | {
            "tokens_per_step": _mean([r["tokens_per_step"] for r in runs]),
            "tokens_per_s": _mean([r["tokens_per_s"] for r in runs]),
            "mean_nfe": _mean([r["mean_nfe"] for r in runs]),
            "tokens_per_s_by_seed": [r["tokens_per_s"] for r in runs],
            "levels": {lv: _mean([r["levels"].get(lv) for r in runs]) for lv in first["levels"]},
        }
        | _invocations(runs)
    )


GENERATION_SCORES = ("judge_perplexity", "entropy")


def _generation_over_seeds(runs: list[list[dict]]) -> list[dict]:
    """One model's unconditional samples over seeds, point by point: the judge's perplexity and the
    unigram entropy as mean, spread and each seed's figure; speeds as means; empty samples summed."""
    out = []
    for p in runs[0]:
        same = [next(q for q in r if q["point"] == p["point"]) for r in runs]
        point = {k: v for k, v in p.items() if k not in (*GENERATION_SCORES, "invocation")}
        for key in GENERATION_SCORES:
            values = [q[key] for q in same]
            known = [v for v in values if v is not None]
            std = statistics.stdev(known) if len(known) > 1 else 0.0
            point |= {key: _mean(known), f"{key}_std": std, f"{key}_by_seed": values}
        point |= {
            "samples": sum(q["samples"] for q in same),
            "empty": sum(q["empty"] for q in same),
            "mean_length": _mean([q["mean_length"] for q in same]),
            "tokens_per_step": _mean([q["tokens_per_step"] for q in same]),
            "tokens_per_s": _mean([q["tokens_per_s"] for q in same]),
            "mean_nfe": _mean([q["mean_nfe"] for q in same]),
            "tokens_per_s_by_seed": [q["tokens_per_s"] for q in same],
        }
        out.append(point | _invocations(same))
    return out


def _accuracy(p: dict) -> str:
    """The accuracy cell: over seeds, the mean ± the seeds' standard deviation, each seed's figure,
    and the two standard errors of the mean."""
    if "accuracy_by_seed" not in p:
        return f"{p['accuracy']:.3f}"
    return (
        f"{p['accuracy']:.3f} ± {p['accuracy_std']:.3f} [{', '.join(f'{a:.3f}' for a in p['accuracy_by_seed'])}]; "
        f"SE {p['accuracy_se_seeds']:.3f} seeds, {p['accuracy_se_problems']:.3f} problems"
    )


SETTING_TEXT = {
    "supervised": "Supervised setting: one problem per row, padded to 64 characters, the expression line pinned as "
    "clean context and only the solution (plus EOS) in the loss, as the paper trains its GSM8K models. "
    "Packed setting: pretraining windows of 64 characters across problems, every token a target.",
    "packed": "Packed setting: pretraining windows of 64 characters across problems, every token a target (the "
    "supervised setting, the paper's format, is in ../supervised).",
    "adapted": "Adapted setting, the paper's pipeline: every model starts from one AR base pretrained here on packed "
    "windows of 128 characters (assets/reasoning-ar-base) and is adapted for the same 400 steps on the "
    "supervised records (expression pinned, solution the target), rows of 128 packing about three "
    "problems each. Decoded at W = 1 and at {parallel} parallel points.",
    "budget": "Budget setting: the adapted setting's headline models (AR, set diffusion d = 4, BD3-LM with blocks of "
    "4, MDLM), each adapted from the same AR base (assets/reasoning-ar-base) on the same supervised records for "
    "{budgets} steps (the adapted setting's runs are its 400-step ones), every decoding point as there.",
    "infill": "Infill setting: every model pretrained on packed windows of 64 characters of the chains corpus "
    "(setdiff_megatron/data/chains.py: the reasoning corpus's + and - solutions without their expression lines), "
    "every token a target, as the paper pretrains on OpenWebText; then one held-out line of a chain, a line the "
    "right side decides and the left side leaves open, infilled at its true length, one token per step, with "
    "the context each model can use, as the paper infills ROCStories: AR the left side; set diffusion and MDLM "
    "(the paper's baseline, in one block of the 64 positions, as the reference's MDLM infills in one block of its "
    "length) both sides; BD3-LM (the paper's baseline) as the reference's BD3-LM infills, the input's whole blocks "
    "cached ahead of the span's blocks (both sides, input cached), and with what its own block decoding sees, the right "
    "side up to the end of the span's last block of 4 (the row ', blocks').",
    "unconditional": "Unconditional setting: every model pretrained on packed windows of 64 characters of the "
    "reasoning corpus (the packed setting's recipes; MDLM and BD3-LM, the paper's baselines, among them), then "
    "sampled from an empty prompt at temperature 1, each sample one document (it ends at its first EOS), at "
    "one token per step and in parallel (set diffusion: W = 4 and 8 at thresholds 0.9, 0.7, 0.5; MDLM in one "
    "block of 32 and BD3-LM over its blocks of 4, at thresholds off, 0.9, 0.7, 0.5), as the paper samples "
    "OpenWebText models; judged by an AR model trained four times as long on the same corpus "
    "(recipes/study/packed/ar-judge.yaml; the paper's judge is GPT-2 Large).",
}
SEEDED_GENERATION_TEXT = (
    "Every model trained once per training seed (corpus fixed; a seed's samples drawn with its own seeds). "
    "Judge perplexity and entropy: the mean over seeds ± the seeds' standard deviation, each seed's figure "
    "in brackets; speeds are means."
)
BASELINE_TEXT = (
    "MDLM and BD3-LM are the paper's baselines (`method.family`), trained with the same data, tokens and steps; "
    "each decodes over its blocks (MDLM 32, and 8 at threshold 0.9 as a labelled extra point; BD3-LM its own) at "
    "thresholds off (one token per step), 0.99, 0.9 (the paper's default), 0.7 and 0.5; their points name the "
    "block (b) and threshold (t), and they have no window. Their validation losses are their own objectives' "
    "(masked tokens only), not comparable with set diffusion's."
)
SEEDED_TEXT = (
    "Every model trained once per training seed (corpus and test problems fixed). Accuracy: the mean "
    "over seeds ± the seeds' standard deviation, each seed's figure in brackets, and the standard error "
    "of the mean from the seed spread and from the test problems (binomial); speeds are means. Two "
    "figures whose difference is within about twice the combined standard error are within noise."
)
SEEDED_INFILL_TEXT = (
    "Every model trained once per training seed (corpus and held-out chains fixed). Scores: the mean over seeds "
    "± the seeds' standard deviation, each seed's figure in brackets; speeds are means. results.json has the "
    "standard errors (exact match's from the seeds and, binomial, from the examples)."
)
NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _head(*columns: str) -> list[str]:
    """A markdown table's header and rule."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _train_minutes(results: dict) -> float:
    return sum(m["train_minutes"] for group in ("models", "code_models") for m in results[group].values())


def _setting_text(results: dict) -> str:
    setting, models = results.get("setting", "packed"), results["models"]
    parallel = max((len(m["points"]) - 1 for m in models.values() if m["family"].startswith("sd")), default=0)
    budgets = ", ".join(str(b) for b in results.get("budgets", ()))
    words = NUMBER_WORDS[parallel] if parallel < len(NUMBER_WORDS) else str(parallel)
    text = SETTING_TEXT[setting]
    if not parallel:  # no set diffusion model in these results
        text = text.replace(" Decoded at W = 1 and at {parallel} parallel points.", "")
    text = text.format(parallel=words, budgets=budgets)
    baselines = setting not in ("infill", "unconditional") and any(
        m["family"] in ("mdlm", "bd3lm") for m in models.values()
    )
    return text + (f" {BASELINE_TEXT}" if baselines else "")


def _seeded_text(setting: str | None) -> str:
    return {"infill": SEEDED_INFILL_TEXT, "unconditional": SEEDED_GENERATION_TEXT}.get(setting, SEEDED_TEXT)


def _speeds_text(results: dict) -> list[str]:
    """Which invocations of the study measured the tokens/s figures, where recorded: speeds from
    different invocations met different loads on the machine."""
    seen = sorted(
        {
            i
            for m in results["models"].values()
            for item in [
                *m["points"],
                *m.get("generation", []),
                *([m["infill_chains"]] if "infill_chains" in m else []),
            ]
            for i in item.get("invocation_by_seed", [item.get("invocation")])
            if i is not None
        }
    )
    if not seen:
        return []
    load = results.get("load_average")
    load_text = (
        f" The load average (1 minute) was {load['start']:.1f} at this invocation's start and {load['end']:.1f} at "
        f"its end, on {results['machine']['cpu_count']} CPUs: speeds fall when other work shares them."
        if load
        else ""
    )
    if len(seen) == 1:
        return [f"Every tokens/s figure was measured in one invocation of the study, {seen[0]}.{load_text}", ""]
    return [
        f"The tokens/s figures were measured in {len(seen)} invocations of the study ({', '.join(seen)}), under "
        "whatever else loaded the machine each time: compare speeds across invocations with care. results.json "
        f"names each figure's (`invocation`, over seeds `invocation_by_seed`).{load_text}",
        "",
    ]


def _header(results: dict) -> list[str]:
    """The title, the setting, the statistics over seeds, the machine, the invocation and its speeds."""
    seeded = any("seeds" in m for m in results["models"].values())
    return [
        f"# Study results ({results['mode']} run, {results.get('setting', 'packed')} setting)",
        "",
        _setting_text(results),
        "",
        *([_seeded_text(results.get("setting")), ""] if seeded else []),
        f"Machine: {results['machine']}. Training: {_train_minutes(results):.0f} minutes for all models (their "
        f"logged step times). This invocation started {results['started']} and took {results['wall_minutes']:.1f} "
        "minutes (a rerun skips the models and points already done). "
        f"Command: `{results['command']}`. Seeds: {results['seeds']}.",
        "",
        *_merges_text(results),
        *_speeds_text(results),
    ]


def _merges_text(results: dict) -> list[str]:
    """The invocations that put some models' entries in later (`--merge`, `--per-run`)."""
    return [
        f"Merged in later: {', '.join(m['models'])}, by `{m['command']}` (started {m['started']}, "
        f"{m['wall_minutes']:.1f} minutes, load average {m['load_average']['start']:.1f} to "
        f"{m['load_average']['end']:.1f}); their figures replace those of the invocation above.\n"
        for m in results.get("merges", [])
    ] + [
        f"From run files (`--per-run`, runs/ beside this file, each naming its commit and decoding invocation): "
        f"{', '.join(m['models'])}, gathered by `{m['command']}` (started {m['started']}).\n"
        for m in results.get("per_run", [])
    ]


def markdown(results: dict) -> str:
    """The tables of results.md: likelihood, every decoding point, per-level accuracy, infilling
    (the infill setting's own: `infill_markdown`), and the budget setting's gaps to AR."""
    models = results["models"]
    setting = results.get("setting", "packed")
    if setting == "infill":
        return infill_markdown(results)
    if setting == "unconditional":
        return unconditional_markdown(results)
    out = [
        *_header(results),
        "## Training and held-out likelihood (nats per token, test problems)",
        "",
        *(
            [
                "Supervised models are scored on their responses (the final validation loss); the "
                "likelihood of whole problems is the packed setting's (its models learned the prompts too).",
                "",
            ]
            if setting == "supervised"
            else []
        ),
        "| model | trained steps | train minutes | exact left-to-right NLL | NELBO, own policy (95 % CI) | final valid loss |",
        "|---|---|---|---|---|---|",
    ]
    for m in models.values():
        nll, nelbo = m.get("nll_left_to_right"), m.get("nelbo_own_policy")
        ci = nelbo and nelbo.get("ci95_half_width")
        out.append(
            f"| {m['label']} | {m['steps']} | {_fmt(m.get('train_minutes'), '.1f')} | "
            f"{_fmt(nll and nll['nll_per_token'], '.4f')} | "
            f"{_fmt(nelbo and nelbo['nll_per_token'], '.4f')}{f' ± {ci:.4f}' if ci else ''} | "
            f"{_fmt(m['valid_curve'][-1][1] if m['valid_curve'] else None, '.4f')} |"
        )
    out += [
        "",
        "## Accuracy against decoding speed (batch 16)",
        "",
        f"Trivial baseline: {results['trivial_baseline']:.3f} (the most common answer of the test problems, "
        "given to every problem).",
        "",
        "| model | point | W | tau | accuracy | tokens/step | tokens/s | mean NFE |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in models.values():
        for p in m["points"]:
            window = "-" if m["family"] in ("mdlm", "bd3lm") else p["window"]  # they decode blocks, no window
            out.append(
                f"| {m['label']} | {p['point']} | {window} | {_fmt(p['threshold'], 'g')} | "
                f"{_accuracy(p)} | {p['tokens_per_step']:.2f} | {_fmt(p['tokens_per_s'], '.0f')} | "
                f"{p['mean_nfe']:.1f} |"
            )
    levels = sorted({lv for m in models.values() for p in m["points"] for lv in p["levels"]})
    out += [
        "",
        "## Accuracy by difficulty level (each model's most accurate point)",
        "",
        *_head("model", "point", *levels),
    ]
    for m in models.values():
        if m["points"]:
            best = max(m["points"], key=lambda p: p["accuracy"])
            out.append(
                f"| {m['label']} | {best['point']} | "
                + " | ".join(_fmt(best["levels"].get(lv), ".3f") for lv in levels)
                + " |"
            )
    infill_rows = [
        (task, m)
        for task in ("jsonl", "code")
        for m in [*models.values(), *results.get("code_models", {}).values()]
        if m.get(f"infill_{task}")
    ]
    if infill_rows:
        out += [
            "",
            "## Infilling (span at its true length; one token per step)",
            "",
            "| task | model | context | exact match | ROUGE-1 | ROUGE-2 | ROUGE-L | examples |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for task, m in infill_rows:
            r = m[f"infill_{task}"]
            label = "solution lines" if task == "jsonl" else "stdlib bodies"
            out.append(
                f"| {label} | {m['label']} | {r['context']} | {r['exact_match']:.3f} | {r['rouge1']:.3f} | "
                f"{r['rouge2']:.3f} | {r['rougeL']:.3f} | {r['examples']} |"
            )
    if setting == "budget":
        out += ["", *claims.budget_table(results)]
    return "\n".join(out) + "\n"


def _score(r: dict, key: str) -> str:
    """An infill score: over seeds, the mean ± the seeds' standard deviation and each seed's figure."""
    if f"{key}_by_seed" not in r:
        return f"{r[key]:.3f}"
    return f"{r[key]:.3f} ± {r[f'{key}_std']:.3f} [{', '.join(f'{v:.3f}' for v in r[f'{key}_by_seed'])}]"


def _training_table(models: dict) -> list[str]:
    """Each model's steps, training time and final validation loss (settings without likelihood)."""
    return [
        "## Training",
        "",
        "| model | trained steps | train minutes | final valid loss |",
        "|---|---|---|---|",
        *(
            f"| {m['label']} | {m['steps']} | {_fmt(m.get('train_minutes'), '.1f')} | "
            f"{_fmt(m['valid_curve'][-1][1] if m['valid_curve'] else None, '.4f')} |"
            for m in models.values()
        ),
    ]


def infill_markdown(results: dict) -> str:
    """The infill setting's tables: the task's rules, training, and each model's infilling."""
    rules, models = results["infill_baselines"], results["models"]
    levels = list(rules["by_level"])
    out = [
        *_header(results),
        "## The task",
        "",
        f"{rules['examples']} held-out chains ({results['infill_per_level']} per level), one line each masked at "
        "its true length. Exact match of three rules on them (setdiff_megatron/data/chains.py): the trivial "
        "baseline gives every example the most common masked line; the best left-only guess is the most common "
        "line among the training chains with the same left side (the line above's result, the line's index, "
        "the operands' digits) and span length; the right-context rule reads the line off the result above "
        "and the number below.",
        "",
        *_head("rule", "all", *levels),
        *(
            f"| {name} | {rules[key]:.3f} | " + " | ".join(f"{rules['by_level'][lv][key]:.3f}" for lv in levels) + " |"
            for key, name in (
                ("trivial", "trivial baseline"),
                ("left_only", "best left-only guess"),
                ("right_context", "right-context rule"),
            )
        ),
        "",
        *_training_table(models),
        "",
        "## Infilling (the masked line at its true length; one token per step, batch 16)",
        "",
        "| model | context | exact match | ROUGE-1 | ROUGE-2 | ROUGE-L | tokens/step | tokens/s | examples |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in (row for m in models.values() for row in claims.infill_variants(m)):
        out.append(
            f"| {label} | {claims.infill_context(r)} | {_score(r, 'exact_match')} | {_score(r, 'rouge1')} | "
            f"{_score(r, 'rouge2')} | {_score(r, 'rougeL')} | {r['tokens_per_step']:.2f} | "
            f"{_fmt(r['tokens_per_s'], '.0f')} | {r['examples']} |"
        )
    out += [
        "",
        "Exact match by level:",
        "",
        *_head("model", *levels),
        *(
            f"| {label} | " + " | ".join(_fmt(r["levels"].get(lv), ".3f") for lv in levels) + " |"
            for m in models.values()
            for label, r in claims.infill_variants(m)
        ),
    ]
    return "\n".join(out) + "\n"


def _spread(p: dict, key: str, spec: str) -> str:
    """A generation figure: over seeds, the mean ± the seeds' standard deviation and each seed's figure."""
    if p[key] is None:
        return "-"
    if f"{key}_by_seed" not in p:
        return format(p[key], spec)
    seeds = ", ".join(_fmt(v, spec) for v in p[f"{key}_by_seed"])
    return f"{p[key]:{spec}} ± {p[f'{key}_std']:{spec}} [{seeds}]"


def unconditional_markdown(results: dict) -> str:
    """The unconditional setting's tables: training, and each model's samples at each point beside
    the corpus's held-out documents."""
    models, ref = results["models"], results["reference"]
    out = [
        *_header(results),
        *_training_table(models),
        "",
        f"## Unconditional samples ({results['samples']} a point and seed, batch 16; judge: {results['judge']['label']})",
        "",
        "Judge perplexity: exp of the judge's NLL per token of the samples, each read as a document "
        "(lower: more plausible). Entropy: the mean over samples of each sample's unigram entropy over "
        "its characters, in nats (a model that repeats itself scores low).",
        "",
        "| model | point | W | tau | judge perplexity | entropy | mean length | empty | tokens/step | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| held-out documents ({ref['documents']}) | - | - | - | {ref['judge_perplexity']:.3f} | "
        f"{ref['entropy']:.3f} | {ref['mean_length']:.1f} | - | - | - |",
    ]
    for m in models.values():
        for p in m["generation"]:
            out.append(
                f"| {m['label']} | {p['point']} | {p.get('window') or '-'} | {_fmt(p.get('threshold'), 'g')} | "
                f"{_spread(p, 'judge_perplexity', '.3f')} | {_spread(p, 'entropy', '.3f')} | "
                f"{p['mean_length']:.1f} | {p['empty']} | {p['tokens_per_step']:.2f} | {_fmt(p['tokens_per_s'], '.0f')} |"
            )
    return "\n".join(out) + "\n"


def write(results: dict, directory: Path) -> None:
    """results.json, then the report drawn from it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    render(results, directory)


def render(results: dict, directory: Path) -> None:
    """results.md and the plots from `results` alone, so that an existing results.json can be
    drawn again (`--report-only`) without training or evaluating anything."""
    (directory / "results.md").write_text(markdown(results), encoding="utf-8")
    if any(m["points"] for m in results["models"].values()):
        plot_pareto(results, directory / "pareto.png")
    if any(m.get("generation") for m in results["models"].values()):
        plot_pareto(results, directory / "pareto.png", JUDGE_PERPLEXITY)
    plot_infill(results, directory / "infill.png")
    plot_curves(results, directory / "loss_curves.png")
