"""What the study trains and how it decodes: the models, the decoding grid, the infill settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "study"

SETTINGS = ("supervised", "packed", "adapted")
"""The paper's format for its reasoning models first (one problem per padded row, the expression
pinned as the prompt, the solution the target), then packed pretraining windows: the right models
for likelihood and infilling, as the paper uses its OpenWebText models for those; then the paper's
pipeline, every model adapted from one pretrained AR base (recipes/study/adapted/)."""

WINDOWS = (4, 8, 16)
THRESHOLDS = (0.5, 0.7, 0.9, 0.99)
QUICK_POINT = {"window": 4, "threshold": 0.9}
"""The paper's default policy for d = 4: with W = 1, the points of --quick, where its test reads
its thresholds."""
ADAPTED_POINTS = (
    {"name": "w4-t0.9", "window": 4, "threshold": 0.9},
    {"name": "w4-t0.7", "window": 4, "threshold": 0.7},
    {"name": "w8-t0.9", "window": 8, "threshold": 0.9},
)
"""The adapted setting decodes at W = 1 and these points, not the whole grid: it runs every model
over seeds, and the paper's question there is the gap to AR at 2.5 tokens per step and beyond."""


@dataclass(frozen=True)
class Model:
    name: str
    family: str
    """The order policy it was trained with: ar (left to right), sd (the staggered schedule),
    sd-uniform or sd-block (set diffusion with core/orders.py's Uniform or Block order; not the
    paper's MDLM and BD3-LM baselines, which are other models)."""
    label: str
    block_size: int | None = None
    setting: str = "supervised"
    seed: int | None = None
    """train.seed of this run; None: the recipe's."""

    @property
    def recipe(self) -> Path:
        """recipes/study/<name>.yaml; the packed and adapted settings' reasoning models are under
        packed/ and adapted/."""
        folder = "" if self.setting == "supervised" or self.name.startswith("code-") else self.setting
        return RECIPES / folder / f"{self.name}.yaml"

    @property
    def key(self) -> str:
        """The name of its run and evaluation directories: one per training seed."""
        return self.name if self.seed is None else f"{self.name}-seed{self.seed}"

    def decoding_defaults(self) -> dict:
        """Sweep settings every point of this model shares: a block order decodes block by block."""
        return {"block_size": self.block_size} if self.family == "sd-block" else {}

    def grid(self, quick: bool) -> tuple[list[dict], dict[str, list]]:
        """(explicit points, grid) of this model's sweep. AR has the one point W = 1; the others
        decode at W = 1 too (left to right, one token per step), which tells the quality of the
        model apart from what parallel, any-order decoding costs it."""
        if self.family == "ar":
            return [{"name": "ar", "window": 1}], {}
        one = {"name": "w1", "window": 1}
        if quick:
            return [one, dict(QUICK_POINT)], {}
        if self.setting == "adapted":
            return [one, *map(dict, ADAPTED_POINTS)], {}
        return [one], {"window": list(WINDOWS), "threshold": list(THRESHOLDS)}

    def infill(self) -> dict:
        """The infill job's context and decoding: one token per step, the context the order can use
        (AR: the left side; a block order: up to the end of the span's block; the others: both sides)."""
        if self.family == "ar":
            return {"context": "left", "window": 1}
        if self.family == "sd-block":
            return {"context": "blocks", "window": self.block_size, "block_size": self.block_size}
        return {"context": "both", "window": 16}


REASONING_MODELS = (
    Model("ar", "ar", "AR (d=1)"),
    Model("sd-d2", "sd", "set diffusion d=2"),
    Model("sd-d4", "sd", "set diffusion d=4"),
    Model("sd-d8", "sd", "set diffusion d=8"),
    Model("sd-uniform", "sd-uniform", "set diffusion, uniform order"),
    Model("sd-block4", "sd-block", "set diffusion, block order (4)", block_size=4),
    Model("sd-block8", "sd-block", "set diffusion, block order (8)", block_size=8),
)
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


def models(quick: bool, setting: str = "supervised") -> tuple[list[Model], list[Model]]:
    """(reasoning models, code models) of a run; code models (pretraining on the stdlib corpus)
    belong to the packed setting."""
    reasoning = [replace(m, setting=setting) for m in REASONING_MODELS]
    if quick:
        return [m for m in reasoning if m.name in QUICK_MODELS], []
    return reasoning, [replace(m, setting="packed") for m in CODE_MODELS] if setting == "packed" else []
