"""What the study trains and how it decodes: the models, their decoding points, the infill settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "study"

SETTINGS = ("supervised", "packed", "adapted", "infill", "budget", "unconditional")
"""The paper's format for its reasoning models first (one problem per padded row, the expression
pinned as the prompt, the solution the target), then packed pretraining windows; then the paper's
pipeline, every model adapted from one pretrained AR base (recipes/study/adapted/); then the
infilling setting, models pretrained on packed chains whose masked line the right side decides
(recipes/study/infill/, data/chains.py); then the adapted setting's headline models at several
adaptation budgets (`--budgets`)."""

WINDOWS = (4, 8, 16)
THRESHOLDS = (0.5, 0.7, 0.9, 0.99)
QUICK_POINT = {"window": 4, "threshold": 0.9}
"""The paper's default policy for d = 4: with W = 1, the points of --quick, where its test reads
its thresholds."""
ADAPTED_POINTS = (
    {"name": "w4-t0.99", "window": 4, "threshold": 0.99},
    {"name": "w4-t0.9", "window": 4, "threshold": 0.9},
    {"name": "w4-t0.7", "window": 4, "threshold": 0.7},
    {"name": "w4-t0.5", "window": 4, "threshold": 0.5},
    {"name": "w8-t0.9", "window": 8, "threshold": 0.9},
)
"""The adapted setting's set diffusion points besides W = 1, not the whole grid: it runs every
model over seeds (and budgets), and the paper's question there is the trade-off at 2.5 tokens per
step and beyond: a threshold sweep at W = 4 (the paper's default policy for d = 4 at 0.9) and
W = 8 at 0.9. Runs of 2026-12-04 and before decoded the middle three only."""
BASELINE_THRESHOLDS = (None, 0.99, 0.9, 0.7, 0.5)
"""MDLM's and BD3-LM's sweep over their blocks: None decodes one token per step (the reference's
1e6), 0.9 is their paper default."""
BASELINE_PROTOCOLS = (("", False), ("-aligned", True))
"""Where MDLM's and BD3-LM's blocks start (DecodingConfig.align_inputs_to_blocks), by point-name
suffix: every baseline point is decoded both ways. The paper's throughput scripts start the first
block at the prompt's end (False, the families' policy); True starts blocks at multiples of the
block size, the prompt's tail in the first one, as the study decoded before 2026-12-07."""
MDLM_BLOCK = 32
"""MDLM's paper default block (the reference decodes GSM8K in semi-autoregressive blocks of 32):
a completion of 30 to 50 characters spans two blocks."""
MDLM_SMALL_BLOCK = 8
"""A labelled extra point of MDLM, at threshold 0.9: blocks of 8, nearer the completions' lines."""
ADAPTED_STEPS = 400
"""The adapted setting's budget (recipes/study/adapted/common.yaml); the budget setting's runs
of this many steps are the adapted setting's own (same keys, same run directories)."""
BUDGET_MODELS = ("ar", "sd-d4", "mdlm", "bd3lm-b4")
"""The adapted setting's headline models, trained at every budget of `--budgets`."""
BUDGETS = (400, 1600, 6400)
"""The default `--budgets`: the adapted budget, 4 and 16 times it; the lead of a run sets its own.
6,400 steps is the budget at which set diffusion d = 4 from random weights holds within 5 points
over seeds (validation loss 0.014 to 0.017; docs/study.md). A probe of d = 4 from the base under a
1,600-step schedule (one seed, 2026-12-05, stopped after 10 minutes) had not flattened: validation
loss 0.235, 0.177, 0.134, 0.108 at steps 400, 600, 800, 1,000, still falling about a tenth every
100 steps."""
INFILL_LENGTH = 64
"""The infill models' trained length (recipes/study/infill/data.yaml): MDLM infills in one block of
it, as the reference infills ROCStories with MDLM's one block of 1024."""


@dataclass(frozen=True)
class Model:
    name: str
    family: str
    """ar (left to right); sd (set diffusion, the staggered schedule); sd-uniform or sd-block (set
    diffusion with core/orders.py's Uniform or Block order); mdlm or bd3lm (the paper's MDLM and
    BD3-LM baselines, `method.family`: other models, with their own losses and decoders)."""
    label: str
    block_size: int | None = None
    setting: str = "supervised"
    """The folder of its recipe and runs: supervised, packed, adapted or infill (the budget
    setting trains adapted models)."""
    seed: int | None = None
    """train.seed of this run; None: the recipe's."""
    budget: int | None = None
    """train.steps of this run; None: the recipe's."""

    @property
    def recipe(self) -> Path:
        """recipes/study/<name>.yaml; the packed, adapted and infill settings' models are in
        their folders."""
        folder = "" if self.setting == "supervised" or self.name.startswith("code-") else self.setting
        return RECIPES / folder / f"{self.name}.yaml"

    @property
    def key(self) -> str:
        """The name of its run and evaluation directories: one per budget and training seed."""
        return (
            self.name
            + ("" if self.budget is None else f"-steps{self.budget}")
            + ("" if self.seed is None else f"-seed{self.seed}")
        )

    @property
    def group(self) -> str:
        """The name of its entry in results.json: its runs over seeds are one entry."""
        return self.name if self.budget is None else f"{self.name}-steps{self.budget}"

    def decoding_defaults(self) -> dict:
        """Sweep settings every point of this model shares: a block order and BD3-LM decode block
        by block."""
        if self.family in ("sd-block", "bd3lm"):
            return {"block_size": self.block_size}
        return {"block_size": MDLM_BLOCK} if self.family == "mdlm" else {}

    def grid(self, quick: bool) -> tuple[list[dict], dict[str, list]]:
        """(explicit points, grid) of this model's sweep. AR has the one point W = 1; set diffusion
        decodes at W = 1 too (left to right, one token per step), which tells the quality of the
        model apart from what parallel, any-order decoding costs it; MDLM and BD3-LM sweep the
        threshold over their blocks, from one token per step (`toff`) to 0.5, under both block
        placements (BASELINE_PROTOCOLS)."""
        if self.family == "ar":
            return [{"name": "ar", "window": 1}], {}
        if self.family in ("mdlm", "bd3lm"):
            block = self.decoding_defaults()["block_size"]
            points = [{"name": f"b{block}-t{threshold_name(t)}", "threshold": t} for t in BASELINE_THRESHOLDS]
            if self.family == "mdlm":
                points.append({"name": f"b{MDLM_SMALL_BLOCK}-t0.9", "block_size": MDLM_SMALL_BLOCK, "threshold": 0.9})
            placed = [
                p | {"name": p["name"] + suffix, "align_inputs_to_blocks": align}
                for suffix, align in BASELINE_PROTOCOLS
                for p in points
            ]
            return placed, {}
        one = {"name": "w1", "window": 1}
        if quick:
            return [one, dict(QUICK_POINT)], {}
        if self.setting == "adapted":
            return [one, *map(dict, ADAPTED_POINTS)], {}
        return [one], {"window": list(WINDOWS), "threshold": list(THRESHOLDS)}

    def infills(self) -> dict[str, dict]:
        """The infill jobs' contexts and decodings by variant ("" first, the one the claims read
        first), one token per step: the context the model can use (AR: the left side; a block
        order: up to the end of the span's block, as its block decoding sees it; the others: both
        sides), MDLM in one block of its length. BD3-LM infills twice: as the reference's, the
        input's whole blocks cached ahead of the span's blocks (cache_infill_input), and "blocks", the right
        side up to its span's block end that its own block decoding sees."""
        if self.family == "ar":
            return {"": {"context": "left", "window": 1}}
        blocks = {"context": "blocks", "window": self.block_size, "block_size": self.block_size}
        if self.family == "sd-block":
            return {"": blocks}
        if self.family == "bd3lm":
            return {"": blocks | {"context": "both", "cache_infill_input": True}, "blocks": blocks}
        if self.family == "mdlm":
            return {"": {"context": "both", "window": INFILL_LENGTH, "block_size": INFILL_LENGTH}}
        return {"": {"context": "both", "window": 16}}


def threshold_name(threshold: float | None) -> str:
    """A threshold as decoding points name it: 'off' (one token per step) or its value."""
    return "off" if threshold is None else format(threshold, "g")


REASONING_MODELS = (
    Model("ar", "ar", "AR (d=1)"),
    Model("sd-d2", "sd", "set diffusion d=2"),
    Model("sd-d4", "sd", "set diffusion d=4"),
    Model("sd-d8", "sd", "set diffusion d=8"),
    Model("sd-uniform", "sd-uniform", "set diffusion, uniform order"),
    Model("sd-block4", "sd-block", "set diffusion, block order (4)", block_size=4),
    Model("sd-block8", "sd-block", "set diffusion, block order (8)", block_size=8),
    Model("mdlm", "mdlm", "MDLM"),
    Model("bd3lm-b4", "bd3lm", "BD3-LM (block 4)", block_size=4),
    Model("bd3lm-b8", "bd3lm", "BD3-LM (block 8)", block_size=8),
)
BASELINES = ("mdlm", "bd3lm-b4", "bd3lm-b8")
"""The paper's baselines, in the supervised and adapted settings since 2026-12-05; the packed
setting trains the others only."""
SD_D16 = Model("sd-d16", "sd", "set diffusion d=16")
"""Sets of up to 16 of the 64 positions (m = 32): trained in the infill setting only, the study's
nearest to the paper's infilling model (sets of up to 32), whose orders reach the right side."""
UNCONDITIONAL_MODELS = ("ar", "sd-d2", "sd-d4", "sd-d8", "mdlm", "bd3lm-b4")
"""The unconditional setting's models (recipes/study/packed/: pretrained on packed windows of the
reasoning corpus): the paper's unconditional comparison (AR, set diffusion, MDLM, BD3-LM) here."""
INFILL_MODELS = ("ar", "sd-d4", "sd-d8", "sd-d16", "mdlm", "bd3lm-b4")
"""The infill setting's models (recipes/study/infill/): the paper's infilling comparison (AR,
MDLM, BD3-LM, set diffusion) at this scale."""
CODE_MODELS = (
    Model("code-ar", "ar", "AR (d=1)"),
    Model("code-sd-d4", "sd", "set diffusion d=4"),
    Model("code-sd-uniform", "sd-uniform", "set diffusion, uniform order"),
    Model("code-sd-block4", "sd-block", "set diffusion, block order (4)", block_size=4),
)
"""Trained on the built-in stdlib corpus for the code infill task (recipes/study/code-*.yaml)."""
QUICK_MODELS = ("sd-d4",)
"""--quick trains set diffusion d = 4 with its full-study recipe, so it reproduces one seed of the
full run for it (400 adapted steps, about 2 minutes; 1,750 steps from scratch in the supervised
setting, 9 minutes, where half the steps leave d = 4 short of the task at 0.048 accuracy)."""


def models(
    quick: bool, setting: str = "supervised", budgets: tuple[int, ...] = BUDGETS
) -> tuple[list[Model], list[Model]]:
    """(reasoning models, code models) of a run; code models (pretraining on the stdlib corpus)
    belong to the packed setting. The budget setting's models are adapted ones, one per budget
    (`budgets`; the adapted setting's own at its ADAPTED_STEPS)."""
    if setting == "budget":
        headline = [replace(m, setting="adapted") for m in REASONING_MODELS if m.name in BUDGET_MODELS]
        runs = [
            replace(m, budget=None if b == ADAPTED_STEPS else b, label=f"{m.label}, {b} steps")
            for b in budgets
            for m in headline
        ]
        return runs, []
    if setting == "unconditional":  # the packed setting's recipes, the baselines among them
        return [replace(m, setting="packed") for m in REASONING_MODELS if m.name in UNCONDITIONAL_MODELS], []
    wanted = {"packed": [m.name for m in REASONING_MODELS if m.name not in BASELINES], "infill": INFILL_MODELS}
    candidates = (*REASONING_MODELS, SD_D16) if setting == "infill" else REASONING_MODELS
    order = wanted.get(setting, [m.name for m in REASONING_MODELS])
    reasoning = sorted(
        (replace(m, setting=setting) for m in candidates if m.name in order), key=lambda m: order.index(m.name)
    )
    if quick:
        return [m for m in reasoning if m.name in QUICK_MODELS], []
    return reasoning, [replace(m, setting="packed") for m in CODE_MODELS] if setting == "packed" else []


def parse_seeds(text: str) -> list[int]:
    """--seeds of the study and the RL evidence: argparse reports the ArgumentTypeError's words after the flag's name."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(
            f"expected distinct non-negative integers separated by commas, e.g. 1,2,3; got {text!r}"
        )
    return seeds
