"""The study's results: one JSON, a markdown table, and the plots (Pareto, infill, loss curves)."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from collections import defaultdict
from pathlib import Path

from setdiff_megatron.evaluation.sweep import pareto_front


def level_accuracy(point_dir: Path) -> dict[str, float]:
    """Accuracy per difficulty level of one sweep point (its scored.jsonl carries each task's level)."""
    hits: dict[str, list[float]] = defaultdict(list)
    for line in (point_dir / "scored.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        hits[record["level"]].append(record["accuracy"])
    return {level: sum(v) / len(v) for level, v in sorted(hits.items())}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def over_seeds(entries: dict[int, dict]) -> dict:
    """One model's runs over training seeds as one entry. Each point's accuracy is the mean over
    seeds, with the seeds' standard deviation, the standard error of that mean from the seed spread,
    and the standard error from the test problems (binomial: the same problems serve every seed, so
    the spread over seeds does not contain it); speeds and per-level accuracies are means, the
    validation curve the mean at the steps every run logged. `by_seed` keeps each run's figures."""
    runs = list(entries.values())
    points = []
    for p in runs[0]["points"]:
        same = [next(q for q in r["points"] if q["point"] == p["point"]) for r in runs]
        acc = [q["accuracy"] for q in same]
        mean, std = statistics.fmean(acc), statistics.stdev(acc) if len(acc) > 1 else 0.0
        levels = {lv: _mean([q["levels"].get(lv) for q in same]) for lv in p["levels"]}
        points.append(
            p
            | {
                "accuracy": mean,
                "accuracy_std": std,
                "accuracy_se_seeds": std / math.sqrt(len(acc)),
                "accuracy_se_problems": math.sqrt(mean * (1 - mean) / p["examples"]),
                "accuracy_by_seed": acc,
                "tokens_per_step": _mean([q["tokens_per_step"] for q in same]),
                "tokens_per_s": _mean([q["tokens_per_s"] for q in same]),
                "mean_nfe": _mean([q["mean_nfe"] for q in same]),
                "tokens_per_step_by_seed": [q["tokens_per_step"] for q in same],
                "levels": levels,
            }
        )
    curves = [dict(r["valid_curve"]) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return {k: runs[0][k] for k in ("label", "family", "recipe", "steps")} | {
        "seeds": list(entries),
        "train_minutes": sum(r["train_minutes"] for r in runs),
        "valid_curve": [(s, statistics.fmean(c[s] for c in curves)) for s in steps],
        "points": points,
        "by_seed": {
            str(seed): {k: r[k] for k in ("train_minutes", "valid_curve", "points")} for seed, r in entries.items()
        },
    }


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
    "problems each. Decoded at W = 1 and at three parallel points.",
}


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _train_minutes(results: dict) -> float:
    return sum(m["train_minutes"] for group in ("models", "code_models") for m in results[group].values())


def markdown(results: dict) -> str:
    """The tables of results.md: likelihood, every decoding point, per-level accuracy, infilling."""
    models = results["models"]
    setting = results.get("setting", "packed")
    seeded = any("seeds" in m for m in models.values())
    out = [
        f"# Study results ({results['mode']} run, {setting} setting)",
        "",
        SETTING_TEXT[setting],
        "",
        *(
            [
                "Every model trained once per training seed (corpus and test problems fixed). Accuracy: the mean "
                "over seeds ± the seeds' standard deviation, each seed's figure in brackets, and the standard error "
                "of the mean from the seed spread and from the test problems (binomial); speeds are means. Two "
                "figures whose difference is within about twice the combined standard error are within noise.",
                "",
            ]
            if seeded
            else []
        ),
        f"Machine: {results['machine']}. Training: {_train_minutes(results):.0f} minutes for all models (their "
        f"logged step times). This invocation started {results['started']} and took {results['wall_minutes']:.1f} "
        "minutes (a rerun skips the models and points already done). "
        f"Command: `{results['command']}`. Seeds: {results['seeds']}.",
        "",
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
            out.append(
                f"| {m['label']} | {p['point']} | {p['window']} | {_fmt(p['threshold'], 'g')} | "
                f"{_accuracy(p)} | {p['tokens_per_step']:.2f} | {_fmt(p['tokens_per_s'], '.0f')} | "
                f"{p['mean_nfe']:.1f} |"
            )
    levels = sorted({lv for m in models.values() for p in m["points"] for lv in p["levels"]})
    out += [
        "",
        "## Accuracy by difficulty level (each model's most accurate point)",
        "",
        "| model | point | " + " | ".join(levels) + " |",
        "|---|---|" + "---|" * len(levels),
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
    return "\n".join(out) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def plot_pareto(results: dict, path: Path) -> None:
    """Accuracy against tokens per step and against tokens/s; each model's own frontier joined."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for ax, key, label in (
        (axes[0], "tokens_per_step", "tokens per step (parallelism)"),
        (axes[1], "tokens_per_s", "tokens/s at batch 16 (2 CPU cores)"),
    ):
        for n, m in enumerate(results["models"].values()):
            pts = [p for p in m["points"] if p[key] is not None]
            if not pts:
                continue
            xs, ys = [p[key] for p in pts], [p["accuracy"] for p in pts]
            line = ax.scatter(xs, ys, marker="os^Dv<>"[n % 7], s=22, alpha=0.6)
            if "accuracy_std" in pts[0]:  # over seeds: the seeds' standard deviation
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[p["accuracy_std"] for p in pts],
                    fmt="none",
                    alpha=0.5,
                    ecolor=line.get_facecolor()[0],
                    capsize=2,
                )
            front = pareto_front(xs, ys)
            ax.plot(
                [xs[i] for i in front],
                [ys[i] for i in front],
                "-",
                color=line.get_facecolor()[0],
                marker="os^Dv<>"[n % 7],
                label=m["label"],
            )
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy (#### answer)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    seeds = results["seeds"]["training"]
    fig.suptitle(
        f"Reasoning corpus, {results.get('setting', 'packed')} setting: accuracy against decoding speed\n"
        "(W x tau grid, k = 1; lines: each model's frontier"
        + (f"; means over training seeds {seeds}, bars: their standard deviation)" if isinstance(seeds, list) else ")"),
        fontsize=10,
    )
    _save(fig, path)


def plot_infill(results: dict, path: Path) -> None:
    plt = _plt()
    groups = [
        ("jsonl", "solution lines", results["models"]),
        ("code", "stdlib function bodies", results.get("code_models", {})),
    ]
    groups = [g for g in groups if any(m.get(f"infill_{g[0]}") for m in g[2].values())]
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), constrained_layout=True, squeeze=False)
    for ax, (task, title, models) in zip(axes[0], groups):
        rows = [m for m in models.values() if m.get(f"infill_{task}")]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [m[f"infill_{task}"]["exact_match"] for m in rows], 0.4, label="exact match")
        ax.bar([i + 0.2 for i in x], [m[f"infill_{task}"]["rougeL"] for m in rows], 0.4, label="ROUGE-L")
        # Labels wrapped to the width of a bar pair, so that neighbours do not overlap.
        ticks = [f"{textwrap.fill(m['label'], 15)}\n({m[f'infill_{task}']['context']})" for m in rows]
        ax.set_xticks(list(x), ticks, fontsize=7)
        ax.set_title(f"infilling: {title}")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_curves(results: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for m in results["models"].values():
        if m["valid_curve"]:
            steps, losses = zip(*m["valid_curve"])
            ax.plot(steps, losses, marker=".", label=m["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token, own policy)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Validation loss against step (reasoning corpus)")
    _save(fig, path)


def write(results: dict, directory: Path) -> None:
    """results.json, then the report drawn from it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    render(results, directory)


def render(results: dict, directory: Path) -> None:
    """results.md and the plots from `results` alone, so that an existing results.json can be
    drawn again (`--report-only`) without training or evaluating anything."""
    (directory / "results.md").write_text(markdown(results), encoding="utf-8")
    plot_pareto(results, directory / "pareto.png")
    plot_infill(results, directory / "infill.png")
    plot_curves(results, directory / "loss_curves.png")
