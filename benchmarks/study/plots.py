"""The study's plots: accuracy against decoding speed (Pareto), infilling, validation curves."""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import dataclass
from pathlib import Path

from benchmarks.study.claims import infill_context, infill_variants
from setdiff_megatron.evaluation.sweep import pareto_front

FAMILY_COLOURS = {
    "ar": "black",
    "sd": "tab:blue",
    "sd-uniform": "tab:cyan",
    "sd-block": "tab:green",
    "mdlm": "tab:red",
    "bd3lm": "tab:orange",
}
"""One colour family per model family (AR, set diffusion, its other orders, MDLM, BD3-LM);
models of one family differ by marker and shade."""
MARKERS = "os^Dv<>"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)


def _styles(models: dict) -> dict[str, tuple[tuple, str]]:
    """(colour, marker) of each model: its family's colour, lighter for each further model of it."""
    from matplotlib.colors import to_rgb

    seen: dict[str, int] = {}
    styles = {}
    for n, (name, m) in enumerate(models.items()):
        family = m.get("family", "sd")
        rank = seen[family] = seen.get(family, -1) + 1
        base = to_rgb(FAMILY_COLOURS.get(family, "tab:gray"))
        shade = min(0.6, 0.28 * rank)
        styles[name] = (tuple(c + (1 - c) * shade for c in base), MARKERS[n % len(MARKERS)])
    return styles


@dataclass(frozen=True)
class Figure:
    """What a Pareto plot draws against speed: a list of each model's entry, a score in its
    points, its axis label, and whether more of it is better."""

    points: str
    score: str
    label: str
    higher_is_better: bool


ACCURACY = Figure("points", "accuracy", "test accuracy (#### answer)", True)
JUDGE_PERPLEXITY = Figure("generation", "judge_perplexity", "judge perplexity of the samples (lower: better)", False)


def plot_pareto(results: dict, path: Path, figure: Figure = ACCURACY) -> None:
    """A figure (accuracy by default) against tokens per step and against tokens/s; each model's
    own frontier joined; over seeds, bars of the seeds' standard deviation on both axes where measured."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    styles = _styles(results["models"])
    sign = 1 if figure.higher_is_better else -1
    for ax, key, label in (
        (axes[0], "tokens_per_step", "tokens per step (parallelism)"),
        (axes[1], "tokens_per_s", "tokens/s at batch 16 (2 CPU cores)"),
    ):
        for name, m in results["models"].items():
            pts = [p for p in m.get(figure.points, []) if p[key] is not None and p[figure.score] is not None]
            if not pts:
                continue
            colour, marker = styles[name]
            xs, ys = [p[key] for p in pts], [p[figure.score] for p in pts]
            ax.scatter(xs, ys, marker=marker, s=22, alpha=0.6, color=colour)
            if f"{figure.score}_std" in pts[0]:  # over seeds: the seeds' standard deviation
                x_std = [_std(p.get(f"{key}_by_seed")) for p in pts]
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[p[f"{figure.score}_std"] for p in pts],
                    xerr=x_std if any(x_std) else None,
                    fmt="none",
                    alpha=0.5,
                    ecolor=colour,
                    capsize=2,
                )
            front = pareto_front(xs, [sign * y for y in ys])
            ax.plot([xs[i] for i in front], [ys[i] for i in front], "-", color=colour, marker=marker, label=m["label"])
        ax.set_xlabel(label)
        ax.set_ylabel(figure.label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    seeds = results["seeds"]["training"]
    fig.suptitle(
        f"Reasoning corpus, {results.get('setting', 'packed')} setting: {figure.score.replace('_', ' ')} against "
        "decoding speed\n(each model's decoding points; lines: each model's frontier"
        + (f"; means over training seeds {seeds}, bars: their standard deviation)" if isinstance(seeds, list) else ")"),
        fontsize=10,
    )
    _save(fig, path)


def _std(values: list | None) -> float:
    """The seeds' standard deviation of a figure (0 where fewer than two seeds measured it)."""
    return statistics.stdev(values) if values and len(values) > 1 else 0.0


def plot_infill(results: dict, path: Path) -> None:
    """Exact match and ROUGE-L of each model's infilling, bars of the seeds' standard deviation."""
    plt = _plt()
    groups = [
        ("jsonl", "solution lines", results["models"]),
        ("code", "stdlib function bodies", results.get("code_models", {})),
        ("chains", "chain lines the right side decides", results["models"]),
    ]
    groups = [g for g in groups if any(m.get(f"infill_{g[0]}") for m in g[2].values())]
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), constrained_layout=True, squeeze=False)
    for ax, (task, title, models) in zip(axes[0], groups):
        rows = [r | {"label": label} for m in models.values() for label, r in infill_variants(m, task)]
        x = range(len(rows))
        for offset, key, name in ((-0.2, "exact_match", "exact match"), (0.2, "rougeL", "ROUGE-L")):
            errors = [r.get(f"{key}_std", 0.0) for r in rows]
            ax.bar(
                [i + offset for i in x],
                [r[key] for r in rows],
                0.4,
                yerr=errors if any(errors) else None,
                capsize=2,
                label=name,
            )
        # Labels wrapped to the width of a bar pair, so that neighbours do not overlap.
        ax.set_xticks(list(x), [f"{textwrap.fill(r['label'], 15)}\n({infill_context(r)})" for r in rows], fontsize=7)
        ax.set_title(f"infilling: {title}")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_curves(results: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    styles = _styles(results["models"])
    for name, m in results["models"].items():
        if m["valid_curve"]:
            steps, losses = zip(*m["valid_curve"])
            ax.plot(steps, losses, marker=".", color=styles[name][0], label=m["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token, own objective)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Validation loss against step (reasoning corpus)")
    _save(fig, path)
