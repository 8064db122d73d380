"""Loading a recipe: YAML files with `base:` inheritance, dotted overrides, environment values.

    base: ../tiny-cpu.yaml          # a path relative to this file, or a list of them (left first)
    data:
      datasets:
        - path: ${env:DATA_DIR}/owt_text_document       # ${env:NAME} or ${env:NAME,default}

Command-line overrides (`train.lr=3e-4 parallel.tp=2`) are applied after inheritance; each value
is read as YAML, so `parallel.sequence_parallel=true` is a bool and `launch.env={A: b}` a mapping.
Relative input paths are then found from any working directory (inputs.py).
Every problem becomes one `RecipeError` line naming the file and the key path.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes.inputs import locate_inputs
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["RecipeError", "load_recipe", "save_resolved_recipe", "read_recipe_tree"]

RESOLVED_NAME = "recipe.yaml"
_ENV = re.compile(r"\$\{(?:oc\.)?env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")


class RecipeError(UserError):
    """A recipe that cannot be loaded or validated; the message names file and key path."""


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise RecipeError(f"{path}:{line} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, child: dict) -> dict:
    """Child values win; mappings merge key by key; lists and scalars are replaced whole."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_recipe_tree(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The recipe at `path` merged over its `base:` recipes, before validation."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, path))
        raise RecipeError(f"{_chain[0]}: circular base: {cycle}")
    data = _read_yaml(path)
    bases = data.pop("base", None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(f"{path}: base: must be a path or a list of paths")
    merged: dict = {}
    for base in bases:
        if not (path.parent / base).is_file():
            raise RecipeError(f"{path}: base: {base} not found (paths are relative to this file)")
        merged = _deep_merge(merged, read_recipe_tree(path.parent / base, (*_chain, path)))
    return _deep_merge(merged, data)


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError(f"override {item!r}: expected dotted.key=value, e.g. train.lr=3e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"override {item!r}: {'.'.join(parents[: i + 1])} is not a section")
            node = child
        node[leaf] = value
    return data


def _interpolate(value: Any, where: str, source: Path) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, f"{where}.{k}" if where else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{where}.{i}", source) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def lookup(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise RecipeError(
            f"{source}: {where}: environment variable {name} is not set (set it, or write ${{env:{name},default}})"
        )

    return _ENV.sub(lookup, value)


def _section_type(annotation: Any) -> type | None:
    """The section class inside an annotation such as `X`, `X | None` or `list[X]`."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_type(arg)
        if found is not None:
            return found
    return None


def _fields_of(section: type) -> dict[str, Any]:
    """Field name -> annotation, for pydantic sections and the dataclass model section."""
    if issubclass(section, BaseModel):
        return {name: f.annotation for name, f in section.model_fields.items()}
    return {f.name: f.type for f in dataclasses.fields(section)}


def _field_names(loc: tuple) -> list[str]:
    """Keys allowed at `loc`, for the 'did you mean' hint."""
    section: type | None = Recipe
    for part in loc:
        if section is None:
            return []
        if not isinstance(part, int):
            section = _section_type(_fields_of(section).get(part))
    return list(_fields_of(section)) if section is not None else []


def _format_validation_error(exc: ValidationError, source: Path) -> str:
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "<top level>"
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        allowed = _field_names(loc[:-1])
        guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{guess[0]}'?" if guess else f"; allowed: {', '.join(allowed)}"
        msg = f"unknown key{hint}"
    else:
        msg = err["msg"].removeprefix("Value error, ")
        if "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], (dict, list)):
            msg += f" (got {err['input']!r})"
    more = len(exc.errors()) - 1
    return f"{source}: {key}: {msg}" + (f" (and {more} more error{'s' * (more > 1)})" if more else "")


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read, merge, override, interpolate and type-check a recipe (cross-field rules: `validate`)."""
    source = Path(path)
    data = apply_overrides(read_recipe_tree(source), overrides)
    data = locate_inputs(_interpolate(data, "", source), source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_format_validation_error(exc, source)) from None


def save_resolved_recipe(recipe: Recipe, directory: str | Path) -> Path:
    """Write the fully resolved recipe next to a run's outputs; it reloads to an equal Recipe."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_NAME
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(dump_recipe(recipe))
    tmp.replace(path)
    return path


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
