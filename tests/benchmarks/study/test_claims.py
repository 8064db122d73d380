"""The claims table's rules (benchmarks/study/claims.py) on made-up results whose verdicts are
worked out by hand, and the committed claims.md as the table of the committed results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.study import plan
from benchmarks.study.claims import Side, best_point, claim_rows, claims_markdown, verdict

RESULTS = Path(__file__).parents[3] / "benchmarks" / "results" / "study"


def _side(mean: float, std: float, seeds: int = 3) -> Side:
    return Side("x", mean, std, seeds)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # se of each side 0.03 / sqrt(3); of the difference sqrt(2) times that, 0.0245: 2 se = 0.049
        ((0.70, 0.03), (0.60, 0.03), "holds"),
        ((0.60, 0.03), (0.70, 0.03), "does not hold"),
        ((0.64, 0.03), (0.60, 0.03), "inconclusive"),
        ((0.60, 0.03), (0.64, 0.03), "inconclusive"),
    ],
)
def test_a_difference_counts_beyond_two_standard_errors(a, b, expected):
    v = verdict(_side(*a), _side(*b))
    assert v.verdict == expected
    assert v.difference == pytest.approx(a[0] - b[0]) and v.se == pytest.approx(math.sqrt(2) * 0.03 / math.sqrt(3))


def test_one_seed_is_never_a_verdict():
    v = verdict(_side(0.9, 0.0, seeds=1), _side(0.1, 0.05))
    assert v.verdict == "inconclusive" and v.se is None and "one seed" in v.why


def _point(name: str, accuracy: float, tokens_per_step: float, std: float = 0.01) -> dict:
    return {
        "point": name,
        "accuracy": accuracy,
        "accuracy_std": std,
        "accuracy_by_seed": [accuracy] * 3,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": 100.0 * tokens_per_step,
    }


def _model(label: str, family: str, points: list[dict], steps: int = 400) -> dict:
    return {"label": label, "family": family, "steps": steps, "points": points}


MATH = {
    "seeds": {"training": [1, 2, 3]},
    "test_problems": 250,
    "models": {
        "ar": _model("AR", "ar", [_point("ar", 0.90, 1.0)]),
        "sd-d4": _model("d=4", "sd", [_point("w1", 0.80, 1.0), _point("w4-t0.9", 0.70, 2.6)]),
        # a block order is set diffusion with another order: never set diffusion's side
        "sd-block4": _model("block", "sd-block", [_point("w4-t0.9", 0.99, 2.9)]),
        "mdlm": _model("MDLM", "mdlm", [_point("b32-t0.9", 0.50, 1.8), _point("b32-t0.5", 0.30, 3.0)]),
        "bd3lm-b4": _model("BD3-LM", "bd3lm", [_point("b4-t0.9", 0.69, 2.7), _point("b4-toff", 0.95, 1.0)]),
    },
}


def test_each_side_is_its_familys_best_point_at_the_floor():
    best = best_point(MATH["models"], ("sd",), 2.5)
    assert (best.mean, best.label, best.tokens_per_step) == (0.70, "d=4, w4-t0.9", 2.6)
    assert best_point(MATH["models"], ("bd3lm",), 1.0).mean == 0.95
    assert best_point(MATH["models"], ("bd3lm",), 2.5).mean == 0.69
    assert best_point(MATH["models"], ("mdlm",), 3.5) is None


def _infill(exact: float, std: float) -> dict:
    return {
        "exact_match": exact,
        "exact_match_std": std,
        "exact_match_by_seed": [exact] * 3,
        "rougeL": exact,
        "rougeL_std": std,
        "rougeL_by_seed": [exact] * 3,
        "tokens_per_s": 50.0,
    }


INFILL = {
    "seeds": {"training": [1, 2, 3]},
    "infill_baselines": {"examples": 1000, "left_only": 0.07},
    "models": {
        "sd-d4": _model("d=4", "sd", []) | {"infill_chains": _infill(0.40, 0.02)},
        "bd3lm-b4": _model("BD3-LM", "bd3lm", []) | {"infill_chains": _infill(0.10, 0.02)},
    },
}


def _budget(ar: float, sd: float, losses: tuple[float, float] = (0.051, 0.050)) -> dict:
    """AR and d = 4 at 400 and 6,400 steps; `losses`: d = 4's validation loss at steps 4,800 and 6,400."""
    curve = [(0, 4.4), (3200, 0.08), (4800, losses[0]), (6400, losses[1])]
    return {
        "seeds": {"training": [1, 2, 3]},
        "test_problems": 250,
        "models": {
            "ar": _model("AR", "ar", [_point("ar", 0.90, 1.0)]),
            "sd-d4": _model("d=4", "sd", [_point("w4-t0.9", 0.60, 2.6)]),
            "ar-steps6400": _model("AR", "ar", [_point("ar", ar, 1.0)], steps=6400),
            "sd-d4-steps6400": _model("d=4", "sd", [_point("w4-t0.9", sd, 2.6)], steps=6400) | {"valid_curve": curve},
        },
    }


def test_the_claims_table_of_made_up_settings():
    rows = claim_rows({"supervised": MATH, "infill": INFILL, "budget": _budget(0.95, 0.94)})
    verdicts = [(r.claim.split(" ")[6] if r.claim.startswith("1. Set") else r.claim, r.verdict) for r in rows]
    # supervised: MDLM at >= 1.5 (0.70 vs 0.50) and >= 2.5 (0.70 vs 0.30); BD3-LM at >= 1.5
    # (0.70 vs its 0.69 at 2.7) and >= 2.5 (the same); the adapted setting has no results
    assert [v for _, v in verdicts[:4]] == ["holds", "holds", "inconclusive", "inconclusive"]
    assert [v for _, v in verdicts[4:8]] == ["not run yet"] * 4
    assert [v for _, v in verdicts[8:12]] == ["not run yet"] * 4  # the budget setting holds no baseline
    assert rows[12].verdict == "not tested here"  # summarisation
    assert [r.verdict for r in rows[13:15]] == ["not run yet"] * 2  # unconditional, a row a baseline
    assert [r.verdict for r in rows[15:17]] == ["holds", "holds"]  # infilling: 0.40 against 0.10
    assert rows[-1].verdict == "holds"  # the budget: AR 0.95, set diffusion 0.94, within 2 se
    assert claim_rows({"budget": _budget(0.95, 0.80)})[-1].verdict == "does not hold"  # its loss flat (2 %)
    falling = claim_rows({"budget": _budget(0.95, 0.80, losses=(0.09, 0.064))})[-1]  # as d = 4 at 1,600
    assert falling.verdict == "inconclusive" and "still fell 29% over its last quarter" in falling.why
    assert "0.700 ± 0.010 (d=4, w4-t0.9, 2.60 tokens/step, 260 tokens/s)" in rows[0].measured
    # the models compared, no others, and how the baselines' blocks were placed (recorded with no point here)
    assert rows[0].here.endswith(
        "best at >= 1.5 tokens/step of d=4, MDLM; baseline blocks aligned to multiples of the "
        "block size (not the paper's unaligned throughput protocol)"
    )
    unaligned = {
        **MATH,
        "models": {
            k: {**m, "points": [p | {"align_inputs_to_blocks": False} for p in m["points"]]}
            for k, m in MATH["models"].items()
        },
    }
    assert claim_rows({"supervised": unaligned})[0].here.endswith("(unaligned, as the paper's throughput scripts)")


def test_baselines_decoded_both_ways_give_a_row_for_each_placement():
    """A row per block placement, the paper's (unaligned) first, each reading its own points."""
    mdlm = MATH["models"]["mdlm"]
    both = {
        **mdlm,
        "points": [p | {"align_inputs_to_blocks": True} for p in mdlm["points"]]
        + [
            p | {"point": p["point"], "accuracy": p["accuracy"] - 0.2, "align_inputs_to_blocks": False}
            for p in mdlm["points"]
        ],
    }
    rows = [
        r for r in claim_rows({"supervised": {**MATH, "models": MATH["models"] | {"mdlm": both}}}) if "MDLM" in r.claim
    ]
    supervised = [r for r in rows if r.here.startswith("supervised")]
    assert len(supervised) == 4  # two speed floors, two placements each
    first, second = supervised[:2]
    assert "(unaligned, as the paper's" in first.here and "aligned to multiples" in second.here
    assert "MDLM 0.300" in first.measured and "MDLM 0.500" in second.measured


def test_the_stronger_of_bd3lm_s_infill_contexts_is_the_baseline():
    models = INFILL["models"] | {
        "bd3lm-b4": INFILL["models"]["bd3lm-b4"] | {"infill_chains_blocks": _infill(0.38, 0.02)}
    }
    rows = claim_rows({"infill": INFILL | {"models": models}})[15:17]
    assert [r.verdict for r in rows] == ["inconclusive", "inconclusive"]  # 0.40 against the blocks' 0.38
    assert "BD3-LM, blocks" in rows[0].measured


def test_claim_1_is_read_again_at_the_longest_budget():
    budget = _budget(0.95, 0.80)
    budget["models"] |= {
        "bd3lm-b4": _model("BD3-LM", "bd3lm", [_point("b4-t0.9", 0.75, 2.7)]),
        "bd3lm-b4-steps6400": _model("BD3-LM", "bd3lm", [_point("b4-t0.9", 0.81, 2.7)], steps=6400),
    }
    rows = claim_rows({"budget": budget})[10:12]  # against BD3-LM, at >= 1.5 and >= 2.5
    assert [r.verdict for r in rows] == ["inconclusive"] * 2  # 0.80 against 0.81, not 0.60 against 0.75
    assert "6400 steps" in rows[1].here and "BD3-LM 0.810" in rows[1].measured


def _sampled(name: str, perplexity: float, entropy: float, tokens_per_step: float) -> dict:
    seeds = [perplexity - 0.5, perplexity, perplexity + 0.5]
    point = {"point": name, "judge_perplexity": perplexity, "judge_perplexity_std": 0.5}
    return (
        point
        | {"judge_perplexity_by_seed": seeds, "entropy": entropy, "tokens_per_step": tokens_per_step}
        | {"tokens_per_s": 100.0 * tokens_per_step}
    )


UNCONDITIONAL_RESULTS = {
    "seeds": {"training": [1, 2, 3]},
    "samples": 128,
    "judge": {"label": "AR judge"},
    "reference": {"judge_perplexity": 3.0, "entropy": 2.0},
    "models": {
        "sd-d4": _model("d=4", "sd", [])
        | {"generation": [_sampled("w1", 4.0, 2.0, 1.0), _sampled("w4-t0.9", 5.0, 2.0, 2.6)]},
        # repeats itself: the lowest perplexity, left out for its entropy
        "mdlm": _model("MDLM", "mdlm", [])
        | {"generation": [_sampled("b32-t0.5", 1.5, 1.0, 3.0), _sampled("b32-t0.9", 9.0, 2.1, 1.6)]},
        "bd3lm-b4": _model("BD3-LM", "bd3lm", []) | {"generation": [_sampled("b4-t0.9", 5.2, 1.9, 2.7)]},
    },
}


def test_unconditional_generation_is_read_from_the_judges_perplexity_without_repetition():
    rows = claim_rows({"unconditional": UNCONDITIONAL_RESULTS})[13:17]
    assert [r.claim.split(" ")[6] for r in rows] == ["MDLM's", "MDLM's", "BD3-LM's", "BD3-LM's"]
    # >= 1.5: d = 4 at 5.0 (w1 is too slow) against MDLM's 9.0 (its 1.5 repeats itself); >= 2.5: MDLM none left
    assert rows[0].verdict == "holds" and rows[0].difference.startswith("+4.000")
    assert rows[1].verdict == "not tested here" and "no MDLM point" in rows[1].why
    assert [r.verdict for r in rows[2:]] == ["inconclusive"] * 2  # 5.0 against BD3-LM's 5.2
    assert "entropy >= 1.800 (0.9 of the documents')" in rows[0].here


def test_a_budget_still_landing_run_by_run_is_left_out_of_the_verdicts():
    """The 6,400-step runs land one at a time (--per-run): until every family is there over every
    seed, the verdicts stay at the longest complete budget, and the rows say what is missing."""
    budget = _budget(0.95, 0.80)
    budget["models"] |= {"sd-d4-steps25600": _model("d=4, 25600", "sd", [_point("w4-t0.9", 0.99, 3.6)], steps=25600)}
    budget["models"]["sd-d4-steps25600"]["seeds"] = [1]
    row = claim_rows({"budget": budget})[-1]
    assert row.verdict == "does not hold" and "at the longest budget, 6400 steps" in row.why
    assert row.here.endswith("25600 steps not complete yet (no ar model, d=4, 25600 has seeds [1])")
    one_seed = _budget(0.95, 0.80)
    for m in one_seed["models"].values():
        m["seeds"] = [1]
    assert claim_rows({"budget": one_seed})[-1].verdict == "not run yet"
    assert claim_rows({"budget": one_seed})[8].verdict == "not run yet"  # claim 1 at no budget


def test_results_without_the_baselines_are_not_run_yet():
    old = MATH | {"models": {k: m for k, m in MATH["models"].items() if k not in plan.BASELINES}}
    rows = claim_rows({"adapted": old})[4:8]
    assert {r.verdict for r in rows} == {"not run yet"} and "no MDLM model" in rows[0].why


def test_the_committed_claims_table_is_that_of_the_committed_results():
    by_setting = {
        s: json.loads((RESULTS / s / "results.json").read_text(encoding="utf-8"))
        for s in plan.SETTINGS
        if (RESULTS / s / "results.json").is_file()
    }
    assert claims_markdown(by_setting) == (RESULTS / "claims.md").read_text(encoding="utf-8")


def test_the_study_page_holds_the_committed_claims_table():
    """docs/study.md shows the table claims.md holds (regenerated with --claims, then pasted)."""
    page = (RESULTS.parents[2] / "docs" / "study.md").read_text(encoding="utf-8")
    rows = [line for line in (RESULTS / "claims.md").read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    assert rows and all(row in page for row in rows)
