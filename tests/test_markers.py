"""The suite's split, read from the source: a test that starts runs is marked `multiproc`.

A test starts runs when it, a function it reaches, or a fixture it uses calls one of STARTERS
(the CLI or torchrun through tests/cli_runs.py, a worker through run_worker), in its own file or
through what that file imports from tests/. `python -m pytest -m "not slow and not multiproc"` is
then the unit tests alone (docs/architecture.md, "Tests").
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent
STARTERS = {("tests.cli_runs", n) for n in ("setdiff", "cli", "torchrun")} | {
    ("tests.models.megatron_cases", "run_worker")
}
LAUNCHES = {"setdiff_megatron.cli", "torch.distributed.run"}
"""Modules whose command lines only tests/cli_runs.py writes."""

Def = tuple[str, str]  # (module, name of a module-level function or class)


@cache
def parsed() -> dict[str, ast.Module]:
    return {
        ".".join(p.relative_to(TESTS.parent).with_suffix("").parts): ast.parse(p.read_text())
        for p in TESTS.rglob("*.py")
    }


def _reads(node: ast.AST) -> tuple[set[str], set[str]]:
    """The names `node` reads, and the parameters of its functions (the fixtures they ask for)."""
    functions = [f for f in ast.walk(node) if isinstance(f, ast.FunctionDef)]
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}, {a.arg for f in functions for a in f.args.args}


def _is_fixture(node: ast.AST) -> bool:
    return any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


@cache
def scopes() -> tuple[dict[Def, set[str]], dict[str, dict[str, Def]], dict[str, list[Def]]]:
    """What each function or class reads; each module's names for the defs of tests/; the fixtures by name."""
    reads, bound, fixtures = {}, {}, {}
    for module, tree in parsed().items():
        bound[module] = {}
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
                bound[module].update({a.asname or a.name: (node.module, a.name) for a in node.names})
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                reads[module, node.name] = _reads(node)
                bound[module][node.name] = (module, node.name)
                if _is_fixture(node):
                    fixtures.setdefault(node.name, []).append((module, node.name))
    return reads, bound, fixtures


def _sees(module: str, fixture_module: str) -> bool:
    """Whether a test of `module` can ask for a fixture of `fixture_module` (its own, or a conftest above it)."""
    package, _, conftest = fixture_module.rpartition(".")
    return fixture_module == module or (conftest == "conftest" and module.startswith(package + "."))


@cache
def starting() -> set[Def]:
    """Every def that starts runs, found by following names until nothing changes."""
    reads, bound, fixtures = scopes()
    found, grew = set(STARTERS), True
    while grew:
        before = len(found)
        for (module, name), (names, params) in reads.items():
            visible = [f for n in params for f in fixtures.get(n, []) if _sees(module, f[0])]
            if {bound[module].get(n) for n in names | params} & found or set(visible) & found:
                found.add((module, name))
        grew = len(found) > before
    return found


def test_every_test_that_starts_runs_is_marked_multiproc():
    """Module-level tests (the suite has no test classes), marked by a decorator or the module's pytestmark."""
    unmarked = []
    for module, tree in parsed().items():
        marks = " ".join(
            ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)
        )
        unmarked += [
            f"{module}.{node.name}"
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (module, node.name) in starting()
            if "mark.multiproc" not in marks + " ".join(map(ast.unparse, node.decorator_list))
        ]
    assert not unmarked, "start runs without the multiproc mark:\n" + "\n".join(unmarked)


def test_only_cli_runs_writes_the_command_lines_of_the_cli_and_torchrun():
    found = [
        module
        for module, tree in parsed().items()
        if module != "tests.cli_runs"
        for node in ast.walk(tree)
        if isinstance(node, ast.List | ast.Tuple)
        and any(isinstance(e, ast.Constant) and e.value in LAUNCHES for e in node.elts)
    ]
    assert not found, f"write their own command line of the CLI or torchrun (use tests/cli_runs.py): {found}"
