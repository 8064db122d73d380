"""The layer rule of docs/architecture.md, "Layers", as a test: every import of the package,
function-level ones included, points to a lower layer (or stays inside its own package); no
package reaches for another one's private names; megatron-core and DeepSpeed are imported only
where named."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "setdiff_megatron"
LAYERS = {
    "core": 1,
    "kernels": 2,
    "sampling": 2,
    "models": 3,
    "data": 4,
    "recipes": 4,
    "distributed": 4,
    "checkpoint": 5,
    "recipe_data": 5,
    "sources": 6,
    "training": 7,
    "hf": 7,
    "inference": 7,
    "evaluation": 8,
    "serving": 8,
    "planning": 8,
    "launch": 9,
    "cli": 10,
}
"""Lowest first. Siblings on one layer do not import each other; the `setdiff` command (cli.py)
sits on top of its launchers."""
SHARED = {"errors", "version", "progress", "log", "machine_cache"}
"""Top-level helpers every layer may use (they import nothing of the package but one another)."""
FRAMEWORKS = {
    "megatron": {
        "models/megatron_model.py",
        "models/megatron_forward.py",
        "models/megatron_moe.py",
        "models/megatron_adaln.py",
        "distributed/megatron_cpu.py",
        "distributed/runtime.py",
        "checkpoint/megatron_shards.py",
        "checkpoint/ema_files.py",
        "data/packing.py",
        "data/indexed.py",
        "training/lr_schedule.py",
        "training/engines/megatron_engine.py",
        "training/engines/deepspeed_config.py",
        "planning/fake_world.py",
        "planning/measure.py",
    },
    "deepspeed": {
        "training/engines/deepspeed_engine.py",
        "sources/deepspeed_checkpoints.py",
        "planning/measure_deepspeed.py",
    },
}
"""Where megatron-core and DeepSpeed may be imported (lazily or not): the megatron body (its MoE
and adaLN layers included) and what megatron's training needs around it, the runtime and its CPU layer, the megatron parts of checkpoint/ and data/,
megatron-core's LR scheduler and optimizer defaults (both engines update alike), each engine, and
the planner's fake world (megatron-core's groups on a fake process group) and its MoE stand-in;
DeepSpeed in its engine, in the reader of its checkpoints, and in the planner's stand-ins for
what fake tensors cannot run in it (its world group, ZeRO-3's host-side check)."""
CORE_ALLOWED = {"torch", "setdiff_megatron"} | set(sys.stdlib_module_names)


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return out


def test_every_package_is_in_the_layer_table():
    packages = {package_of(p) for p in modules()} - SHARED - {"__init__"}
    assert packages <= set(LAYERS), f"add {sorted(packages - set(LAYERS))} to LAYERS (and to the README's table)"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    here = package_of(path)
    problems = []
    for line, module, names in imports(path):
        parts = module.split(".")
        if parts[0] != "setdiff_megatron" or len(parts) < 2:
            continue
        there = parts[1]
        if there == here or there in SHARED:
            continue
        if here in SHARED:
            problems.append(f"line {line}: {module} (a shared helper imports nothing of the package)")
        elif LAYERS[there] >= LAYERS.get(here, 0):
            problems.append(f"line {line}: {module} (layer {LAYERS[there]}) from {here} (layer {LAYERS[here]})")
        private = [n for n in names if n.startswith("_")] + [p for p in parts[2:] if p.startswith("_")]
        if private:
            problems.append(f"line {line}: private names of {there}: {private}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_frameworks_are_imported_only_where_named(framework):
    users = {
        str(p.relative_to(PACKAGE))
        for p in modules()
        if any(module.split(".")[0] == framework for _, module, _ in imports(p))
    }
    assert users <= FRAMEWORKS[framework], f"{framework} imported in {sorted(users - FRAMEWORKS[framework])}"


@pytest.mark.parametrize("package", ["core", "sampling"])
def test_core_and_sampling_import_only_torch_and_stdlib(package):
    for path in (PACKAGE / package).glob("*.py"):
        bad = {module.split(".")[0] for _, module, _ in imports(path)} - CORE_ALLOWED
        assert not bad, f"{path.name} imports {sorted(bad)}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_no_import_cycles_between_modules():
    graph = {_module_name(p): set() for p in modules()}
    for path in modules():
        for _, module, names in imports(path):
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in graph]
            targets = submodules or [module]  # `from pkg import submodule` does not use pkg's own names
            graph[_module_name(path)] |= {t for t in targets if t in graph and t != _module_name(path)}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)
