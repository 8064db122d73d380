"""The paper's claims held against the study's results: the comparisons, their verdicts, the table.

The paper (arXiv 2607.01775) claims set diffusion has 1. a better speed-quality trade-off than
MDLM and BD3-LM on mathematical reasoning, summarisation and unconditional generation, and 2.
stronger infilling than block diffusion. A comparison here sets two sides against each other, the
claimed winner first, each a mean over training seeds with the standard error of that mean from
the seeds' spread (standard deviation / sqrt(seeds)); the difference d (claimed direction
positive) has the standard error se = sqrt(se_a^2 + se_b^2), the two sides' models trained
independently. The verdict (`verdict`):

  holds          d > 2 se
  does not hold  d < -2 se
  inconclusive   otherwise, or a side with fewer than two seeds (no spread to judge by)

A side of a speed-quality comparison is a family's most accurate point at or above a speed floor
(SPEED_FLOORS, tokens per step, the paper's parallelism axis): set diffusion (the staggered
schedule, d = 2, 4, 8; not its uniform and block orders) against MDLM, or against BD3-LM (blocks
of 4 and 8), among the models a setting's results hold (a row names them: a run of a subset
compares fewer). Picking the best of several points flatters each side, set diffusion's (more
models and points) the more; the standard errors do not count that. The test problems are the same for
every model, so their sampling error is shared and left out of se. A side of the infilling
comparison is a family's best exact match (and ROUGE-L) on the chains task; of the unconditional
comparison, a family's lowest judge perplexity at the speed floor among its points that do not
repeat themselves (ENTROPY_SHARE), the baseline's less set diffusion's the difference. Claims the study
has no setting for are "not tested here", with the reason; a setting without results yet is
"not run yet".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

VERDICT_SE = 2.0
"""A difference counts when it is beyond this many standard errors of the difference."""
SPEED_FLOORS = (1.5, 2.5)
"""Tokens per step at or above which each family's best point is compared: moderate parallelism,
and the 2.5 the study's earlier verdicts read the gap to AR at."""
GAP_FLOOR = 2.5
"""The budget setting's question: the gap to AR at 2.5 tokens per step or more."""
FLAT_FALL = 0.05
"""The budget setting reads a validation loss as flattened when it fell by less than this share
over the last quarter of its run: before that, a longer budget may still close a gap."""
SET_DIFFUSION = ("sd",)
BASELINES = {"MDLM": ("mdlm",), "BD3-LM": ("bd3lm",)}


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a figure's mean over seeds, its spread and where it was read."""

    label: str
    mean: float
    std: float
    seeds: int
    tokens_per_step: float | None = None
    tokens_per_s: float | None = None

    @property
    def se(self) -> float | None:
        """The standard error of the mean from the seeds; None with one seed."""
        return self.std / math.sqrt(self.seeds) if self.seeds > 1 else None

    def text(self) -> str:
        speeds = [
            *([f"{self.tokens_per_step:.2f} tokens/step"] if self.tokens_per_step is not None else []),
            *([f"{self.tokens_per_s:.0f} tokens/s"] if self.tokens_per_s is not None else []),
        ]
        spread = f" ± {self.std:.3f}" if self.seeds > 1 else " (one seed)"
        return f"{self.mean:.3f}{spread} ({', '.join([self.label, *speeds])})"


@dataclass(frozen=True)
class Verdict:
    difference: float | None
    se: float | None
    verdict: str
    why: str

    def text(self) -> str:
        if self.difference is None:
            return "-"
        return f"{self.difference:+.3f}" + ("" if self.se is None else f" ± {self.se:.3f}")


def verdict(a: Side, b: Side) -> Verdict:
    """a (the claimed winner) against b, by the module docstring's rule."""
    d = a.mean - b.mean
    if a.se is None or b.se is None:
        return Verdict(d, None, "inconclusive", "a side has one seed: no spread to judge the difference by")
    se = math.hypot(a.se, b.se)
    bound = VERDICT_SE * se
    if d > bound:
        return Verdict(d, se, "holds", f"the difference is above {VERDICT_SE:g} standard errors ({bound:.3f})")
    if d < -bound:
        return Verdict(d, se, "does not hold", f"the difference is below -{VERDICT_SE:g} standard errors ({bound:.3f})")
    return Verdict(d, se, "inconclusive", f"the difference is within {VERDICT_SE:g} standard errors ({bound:.3f})")


def _has(models: dict, families: tuple[str, ...]) -> bool:
    return any(m["family"] in families for m in models.values())


def aligned(point: dict) -> bool:
    """Whether a point's baseline blocks were aligned (DecodingConfig.align_inputs_to_blocks, recorded
    with each point): one that does not record it was decoded before the setting existed, aligned."""
    return point.get("align_inputs_to_blocks", True)


def best_point(models: dict, families: tuple[str, ...], floor: float, placement: bool | None = None) -> Side | None:
    """The most accurate decoding point at or above `floor` tokens per step among `models` of
    `families` (results.json entries), of the block `placement` (`aligned`) where given, or None."""
    candidates = [
        (m, p)
        for m in models.values()
        if m["family"] in families
        for p in m["points"]
        if p["tokens_per_step"] >= floor and placement in (None, aligned(p))
    ]
    if not candidates:
        return None
    return _point_side(*max(candidates, key=lambda mp: mp[1]["accuracy"]), "accuracy")


def _point_side(model: dict, point: dict, score: str) -> Side:
    """A decoding point's `score` as a side: its mean, spread and seeds, where it was read, its speeds."""
    return Side(
        f"{model['label']}, {point['point']}",
        point[score],
        point.get(f"{score}_std", 0.0),
        len(point.get(f"{score}_by_seed", [None])),
        point["tokens_per_step"],
        point["tokens_per_s"],
    )


def infill_variants(m: dict, task: str = "chains") -> list[tuple[str, dict]]:
    """A model's infilling of `task` with each row's label: its own (`infill_<task>`), then its
    other variants' (`infill_<task>_<variant>`: BD3-LM's "blocks", plan.Model.infills)."""
    key = f"infill_{task}"
    return [(m["label"] + k[len(key) :].replace("_", ", ", 1), m[k]) for k in m if k == key or k.startswith(key + "_")]


def infill_context(r: dict) -> str:
    """The context an infill row had, and whether its input's whole blocks were cached (BD3-LM as the reference)."""
    return r["context"] + (", input cached" if r["decoding"].get("cache_infill_input") else "")


def best_infill(models: dict, families: tuple[str, ...], score: str) -> Side | None:
    """The best infilling `score` (exact_match, rougeL) among `models` of `families` and their
    variants (BD3-LM's two contexts: the stronger one is the baseline), or None."""
    rows = [row for m in models.values() if m["family"] in families for row in infill_variants(m)]
    if not rows:
        return None
    label, r = max(rows, key=lambda row: row[1][score])
    return Side(
        label,
        r[score],
        r.get(f"{score}_std", 0.0),
        len(r.get(f"{score}_by_seed", [None])),
        None,
        r["tokens_per_s"],
    )


@dataclass(frozen=True)
class Row:
    claim: str
    paper: str
    here: str
    measured: str
    difference: str
    verdict: str
    why: str


MATH = "1. Set diffusion's speed-quality trade-off beats {name}'s on math reasoning"
MATH_PAPER = "GSM8K; Qwen3-1.7B-Base adapted into each model; accuracy against tokens/s and tokens per step"
SETTING_WORDS = {
    "supervised": "supervised: 4 x 128 models from scratch",
    "adapted": "adapted: 4 x 128 models from one AR base",
    "budget": "budget: the adapted setting's models at its longest budget",
}


def _unmeasured(claim: str, paper: str, here: str, verdict_: str, why: str) -> Row:
    return Row(claim, paper, here, "-", "-", verdict_, why)


def _math_rows(setting: str, results: dict | None) -> list[Row]:
    rows = []
    for name, families in BASELINES.items():
        for floor in SPEED_FLOORS:
            claim = MATH.format(name=name)
            if results is None:
                rows.append(
                    _unmeasured(claim, MATH_PAPER, SETTING_WORDS[setting], "not run yet", f"no {setting} results")
                )
                continue
            models = results["models"]
            steps = next(iter(models.values()))["steps"]  # one budget for every model of a setting
            compared = [m["label"] for m in models.values() if m["family"] in (*SET_DIFFUSION, *families)]
            here = (
                f"{SETTING_WORDS[setting]}, {steps} steps, seeds {results['seeds']['training']}, "
                f"{results['test_problems']} problems; best at >= {floor} tokens/step of {', '.join(compared)}"
            )
            absent = [n for n, f in (("set diffusion", SET_DIFFUSION), (name, families)) if not _has(models, f)]
            if absent:
                why = f"these results hold no {' and no '.join(absent)} model"
                rows.append(_unmeasured(claim, MATH_PAPER, here, "not run yet", why))
                continue
            for placement in _placements(models, families):
                rows.append(
                    _math_row(claim, here + "; " + PLACEMENTS[placement], models, (name, families), floor, placement)
                )
    return rows


def _math_row(
    claim: str, here: str, models: dict, baseline: tuple[str, tuple[str, ...]], floor: float, placement: bool
) -> Row:
    name, families = baseline
    sd, base = best_point(models, SET_DIFFUSION, floor), best_point(models, families, floor, placement)
    if sd is None or base is None:
        missing = "set diffusion" if sd is None else name
        return _unmeasured(claim, MATH_PAPER, here, "not tested here", f"{missing} has no point at >= {floor}")
    v = verdict(sd, base)
    return Row(claim, MATH_PAPER, here, f"set diffusion {sd.text()}; {name} {base.text()}", v.text(), v.verdict, v.why)


PLACEMENTS = {
    False: "baseline blocks from the prompt's end (unaligned, as the paper's throughput scripts)",
    True: "baseline blocks aligned to multiples of the block size (not the paper's unaligned throughput protocol)",
}
"""How a row's baseline points placed their blocks (`aligned`): a setting whose baselines were
decoded both ways has a row for each, the paper's first."""


def _placements(models: dict, families: tuple[str, ...]) -> list[bool]:
    """The block placements among the baselines' points, the paper's (unaligned) first."""
    return sorted({aligned(p) for m in models.values() if m["family"] in families for p in m["points"]})


NOT_TESTED = (
    Row(
        "1. ... on summarisation",
        "CNN/DailyMail; Qwen3-0.6B-shaped models from scratch; ROUGE against tokens/s",
        "-",
        "-",
        "-",
        "not tested here",
        "the study's corpora are generated arithmetic, with no summarisation task; the project's "
        "recipes/cnndm-*.yaml are the paper's setting (the dataset and GPUs)",
    ),
)
INFILL = "2. Set diffusion infills better than block diffusion (BD3-LM): {score}"
INFILL_PAPER = "ROCStories middle sentences; OpenWebText-pretrained models; ROUGE"


def _infill_rows(results: dict | None) -> list[Row]:
    rows = []
    for score, name in (("exact_match", "exact match"), ("rougeL", "ROUGE-L")):
        claim = INFILL.format(score=name)
        if results is None:
            rows.append(_unmeasured(claim, INFILL_PAPER, "infill", "not run yet", "no infill results"))
            continue
        models = results["models"]
        here = (
            f"infill: chain lines the right side decides, {results['infill_baselines']['examples']} lines, seeds "
            f"{results['seeds']['training']} (best left-only guess {results['infill_baselines']['left_only']:.3f})"
        )
        sd, bd3 = best_infill(models, SET_DIFFUSION, score), best_infill(models, BASELINES["BD3-LM"], score)
        if sd is None or bd3 is None:
            rows.append(_unmeasured(claim, INFILL_PAPER, here, "not tested here", "a family was not trained"))
            continue
        v = verdict(sd, bd3)
        rows.append(
            Row(
                claim, INFILL_PAPER, here, f"set diffusion {sd.text()}; BD3-LM {bd3.text()}", v.text(), v.verdict, v.why
            )
        )
    return rows


def _all_budgets(results: dict) -> dict[int, dict]:
    """The budget setting's models grouped by their trained steps."""
    groups: dict[int, dict] = {}
    for key, m in results["models"].items():
        groups.setdefault(m["steps"], {})[key] = m
    return dict(sorted(groups.items()))


def _by_budget(results: dict) -> dict[int, dict]:
    """The complete budgets of `_all_budgets`: a budget is complete when it holds every family the
    setting trains, each over all its training seeds (the 6,400-step runs land a run at a time, and
    a verdict on some of them would compare less)."""
    return {steps: models for steps, models in _all_budgets(results).items() if not _missing(results, models)}


def _missing(results: dict, models: dict) -> list[str]:
    """What one budget's models lack against the whole setting: families, and runs over seeds."""
    families = sorted({m["family"] for m in results["models"].values()} - {m["family"] for m in models.values()})
    seeds = results["seeds"]["training"]
    partial = [
        f"{m['label']} has seeds {m['seeds']}"
        for m in models.values()
        if isinstance(seeds, list) and m.get("seeds", seeds) != seeds
    ]
    return [f"no {' or '.join(families)} model"] * bool(families) + partial


def _incomplete(results: dict) -> str:
    """The budgets left out of the verdicts, with what each lacks ('' when none is)."""
    return "; ".join(
        f"{steps} steps not complete yet ({', '.join(_missing(results, models))})"
        for steps, models in _all_budgets(results).items()
        if _missing(results, models)
    )


def _gap(models: dict) -> tuple[Side | None, Side | None, Verdict | None]:
    """(AR's best point, set diffusion's best at >= GAP_FLOOR, AR's lead over it) in one budget's models."""
    ar, sd = best_point(models, ("ar",), 0.0), best_point(models, SET_DIFFUSION, GAP_FLOOR)
    return ar, sd, (verdict(ar, sd) if ar and sd else None)


def recent_fall(model: dict) -> float | None:
    """The share by which a model's validation loss (mean over seeds) fell over the last quarter of
    its steps; None without a curve that long."""
    curve = model.get("valid_curve") or []
    if not curve:
        return None
    end, last = curve[-1]
    earlier = [loss for step, loss in curve if step <= end * 3 / 4]
    return 1 - last / earlier[-1] if earlier and earlier[-1] > 0 else None


def _longest_budget(results: dict | None) -> dict | None:
    """The budget setting's results at its longest budget, where claim 1 is read again."""
    by_budget = _by_budget(results) if results is not None else {}
    return results | {"models": by_budget[max(by_budget)]} if by_budget else None


BUDGET = "The adapted setting's gap to AR at >= 2.5 tokens/step is its 400-step budget (this study's earlier reading)"


def _budget_row(results: dict | None) -> Row:
    paper = "- (the paper adapts Qwen3-1.7B-Base for a full fine-tuning run)"
    if results is None:
        return _unmeasured(BUDGET, paper, "budget", "not run yet", "no budget results")
    by_budget = _by_budget(results)
    if not by_budget:
        return _unmeasured(BUDGET, paper, "budget", "not run yet", _incomplete(results))
    gaps = {b: _gap(models) for b, models in by_budget.items()}
    here = f"budget: AR and set diffusion d = 4 adapted for {', '.join(map(str, gaps))} steps, seeds {results['seeds']['training']}"
    if left_out := _incomplete(results):
        here += f"; {left_out}"
    measured = "; ".join(f"{b} steps: AR lead {v.text()}" for b, (_, _, v) in gaps.items() if v is not None)
    longest = gaps[max(gaps)][2]
    if longest is None:
        return _unmeasured(
            BUDGET, paper, here, "not tested here", "set diffusion has no point at >= 2.5 at the longest budget"
        )
    if longest.se is None:
        return Row(BUDGET, paper, here, measured, longest.text(), "inconclusive", longest.why)
    closed = longest.difference <= VERDICT_SE * longest.se
    why = (
        f"at the longest budget, {max(gaps)} steps, AR's lead is {'within' if closed else 'beyond'} "
        f"{VERDICT_SE:g} standard errors ({VERDICT_SE * longest.se:.3f})"
    )
    if closed:
        return Row(BUDGET, paper, here, measured, longest.text(), "holds", why)
    falls = [recent_fall(m) for m in by_budget[max(gaps)].values() if m["family"] in SET_DIFFUSION]
    fall = max((f for f in falls if f is not None), default=None)
    if fall is None or fall >= FLAT_FALL:
        still = "has no validation curve" if fall is None else f"still fell {fall:.0%} over its last quarter"
        why += f", but set diffusion's validation loss {still}: a longer budget may close it"
        return Row(BUDGET, paper, here, measured, longest.text(), "inconclusive", why)
    why += f", with set diffusion's validation loss flat (it fell {fall:.0%} over its last quarter)"
    return Row(BUDGET, paper, here, measured, longest.text(), "does not hold", why)


UNCONDITIONAL = "1. Set diffusion's speed-quality trade-off beats {name}'s on unconditional generation"
UNCONDITIONAL_PAPER = "OpenWebText; 110M-parameter models; MAUVE and generative perplexity against tokens/s"
ENTROPY_SHARE = 0.9
"""A point whose samples' mean unigram entropy is under this share of the held-out documents' is
left out of the comparison: a low perplexity bought by repetition is no better sample."""


def best_sample_point(models: dict, families: tuple[str, ...], floor: float, min_entropy: float) -> Side | None:
    """The lowest judge perplexity at or above `floor` tokens per step among `models` of `families`
    (the unconditional setting's entries), of the points whose entropy is at least `min_entropy`."""
    candidates = [
        (m, p)
        for m in models.values()
        if m["family"] in families
        for p in m.get("generation", [])
        if p["tokens_per_step"] >= floor and p["judge_perplexity"] is not None and p["entropy"] >= min_entropy
    ]
    if not candidates:
        return None
    return _point_side(*min(candidates, key=lambda mp: mp[1]["judge_perplexity"]), "judge_perplexity")


def _unconditional_rows(results: dict | None) -> list[Row]:
    """Claim 1 on unconditional generation: per baseline and speed floor, each family's lowest judge
    perplexity among its points that do not repeat themselves (ENTROPY_SHARE); the difference is the
    baseline's perplexity less set diffusion's (set diffusion's claimed direction positive)."""
    rows = []
    for name, families in BASELINES.items():
        for floor in SPEED_FLOORS:
            claim = UNCONDITIONAL.format(name=name)
            if results is None:  # one row a baseline
                rows.append(
                    _unmeasured(claim, UNCONDITIONAL_PAPER, "unconditional", "not run yet", "no unconditional results")
                )
                break
            models, reference = results["models"], results["reference"]
            min_entropy = ENTROPY_SHARE * reference["entropy"]
            here = (
                f"unconditional: 4 x 128 models pretrained on packed windows, seeds {results['seeds']['training']}, "
                f"{results['samples']} samples a point judged by {results['judge']['label']} (held-out documents "
                f"{reference['judge_perplexity']:.3f}); lowest judge perplexity at >= {floor} tokens/step with "
                f"entropy >= {min_entropy:.3f} ({ENTROPY_SHARE:g} of the documents')"
            )
            sd = best_sample_point(models, SET_DIFFUSION, floor, min_entropy)
            baseline = best_sample_point(models, families, floor, min_entropy)
            if sd is None or baseline is None:
                absent = [n for n, side in (("set diffusion", sd), (name, baseline)) if side is None]
                why = f"no {' and no '.join(absent)} point at this speed and entropy"
                rows.append(
                    _unmeasured(
                        claim,
                        UNCONDITIONAL_PAPER,
                        here,
                        "not run yet" if not _has(models, families) else "not tested here",
                        why,
                    )
                )
                continue
            v = verdict(baseline, sd)
            measured = f"set diffusion {sd.text()}; {name} {baseline.text()}"
            rows.append(Row(claim, UNCONDITIONAL_PAPER, here, measured, v.text(), v.verdict, v.why))
    return rows


def claim_rows(by_setting: dict[str, dict]) -> list[Row]:
    """Every row of the claims table from the settings' results (a missing setting: not run yet)."""
    return [
        *_math_rows("supervised", by_setting.get("supervised")),
        *_math_rows("adapted", by_setting.get("adapted")),
        *_math_rows("budget", _longest_budget(by_setting.get("budget"))),
        *NOT_TESTED,
        *_unconditional_rows(by_setting.get("unconditional")),
        *_infill_rows(by_setting.get("infill")),
        _budget_row(by_setting.get("budget")),
    ]


def claims_markdown(by_setting: dict[str, dict]) -> str:
    """The claims table (benchmarks/results/study/claims.md) with the rule it applies."""
    rows = claim_rows(by_setting)
    out = [
        "# The paper's claims against the study",
        "",
        "Generated by `python -m benchmarks.study --claims` from the settings' results.json "
        "(benchmarks/study/claims.py). Figures: mean ± standard deviation over training seeds; the difference "
        "(claimed direction positive) ± its standard error from the seeds' spread. Verdict: holds when the "
        f"difference is above {VERDICT_SE:g} standard errors, does not hold when below -{VERDICT_SE:g}, otherwise "
        "(or with one seed) inconclusive. Each side of a speed-quality comparison is its family's best point at "
        "or above the speed floor, which flatters both sides.",
        "",
        "| claim | paper's setting | this study's setting | measured | difference ± SE | verdict | why |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r.claim} | {r.paper} | {r.here} | {r.measured} | {r.difference} | **{r.verdict}** | {r.why} |"
            for r in rows
        ),
    ]
    return "\n".join(out) + "\n"


def budget_table(results: dict) -> list[str]:
    """The budget setting's section of results.md: per budget, AR's accuracy, each family's best
    point at >= GAP_FLOOR tokens per step, and AR's lead over set diffusion."""
    out = [
        f"## The gap to AR by budget (best points at >= {GAP_FLOOR:g} tokens per step)",
        "",
        "| steps | AR | set diffusion d = 4 | BD3-LM (block 4) | MDLM | AR's lead over set diffusion ± SE |",
        "|---|---|---|---|---|---|",
    ]
    for steps, models in _all_budgets(results).items():
        ar, sd, lead = _gap(models)
        cells = [best_point(models, BASELINES[name], GAP_FLOOR) for name in ("BD3-LM", "MDLM")]
        out.append(
            f"| {steps} | {ar.text() if ar else '-'} | {sd.text() if sd else '-'} | "
            + " | ".join(c.text() if c else "-" for c in cells)
            + f" | {lead.text() if lead else '-'} |"
        )
    return out
