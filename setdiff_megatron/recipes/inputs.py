"""Where a recipe's relative input paths are found, from any working directory.

An input (`model.init_from`, `data.tokenizer`, `data.datasets[].path`, `checkpoint.resume`)
found in the working directory stays as written; otherwise the first of the recipe file's
directory and the directories above it that holds it gives its absolute path. Found nowhere, it
stays as written and the check of the run's files (validation.py) says where it looked. What a
run writes is always relative to the working directory (docs/recipes.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from setdiff_megatron.recipes.schema import BUILTIN_CORPORA

__all__ = ["search_places", "locate_inputs", "where_looked", "dataset_exists"]


def search_places(recipe_file: str | Path) -> list[Path]:
    """The working directory, then the recipe file's directory and every directory above it."""
    here = Path(recipe_file).absolute().parent
    return [Path.cwd(), here, *here.parents]


def dataset_exists(prefix: Path) -> bool:
    """An indexed dataset is named by its prefix: it exists when PREFIX.idx does."""
    return Path(f"{prefix}.idx").is_file()


def _locate(value: Any, recipe_file: str | Path, exists: Callable[[Path], bool]) -> Any:
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    cwd, *others = search_places(recipe_file)
    if exists(cwd / value):
        return value
    found = next((place / value for place in others if exists(place / value)), None)
    return str(found) if found is not None else value


def locate_inputs(data: dict, recipe_file: str | Path) -> dict:
    """The recipe's raw mapping with each relative input path found in `search_places`: kept as
    written when the working directory holds it, else the first other place's absolute path, else
    kept as written."""
    model, section, checkpoint = (data.get(k) for k in ("model", "data", "checkpoint"))
    if isinstance(model, dict) and "init_from" in model:
        model["init_from"] = _locate(model["init_from"], recipe_file, Path.exists)
    if isinstance(section, dict):
        if "tokenizer" in section:
            section["tokenizer"] = _locate(section["tokenizer"], recipe_file, Path.exists)
        for dataset in section.get("datasets") or ():
            if isinstance(dataset, dict) and dataset.get("path") not in BUILTIN_CORPORA:
                dataset["path"] = _locate(dataset.get("path"), recipe_file, dataset_exists)
    if isinstance(checkpoint, dict) and checkpoint.get("resume") not in (None, "auto", "none"):
        checkpoint["resume"] = _locate(checkpoint["resume"], recipe_file, Path.exists)
    return data


def where_looked(value: str, recipe_file: str | Path | None) -> str:
    """' (looked in ...)' for a relative path found nowhere; '' for an absolute one."""
    if Path(value).is_absolute():
        return ""
    if recipe_file is None:
        return f" (looked in the working directory {Path.cwd()})"
    cwd, here, *_ = search_places(recipe_file)
    return f" (looked in the working directory {cwd}, then in {here} and each directory above it)"
