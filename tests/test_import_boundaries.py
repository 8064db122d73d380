"""core/ holds the math and imports nothing but torch and the standard library (STYLE.md G1)."""

import ast
import sys
from pathlib import Path

CORE = Path(__file__).parents[1] / "setdiff_megatron" / "core"
ALLOWED = {"torch", "setdiff_megatron"} | set(sys.stdlib_module_names)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module.startswith("setdiff_megatron.") and not node.module.startswith("setdiff_megatron.core"):
                roots.add(node.module)
            roots.add(node.module.split(".")[0])
    return roots


def test_core_imports_only_torch_and_stdlib():
    for path in CORE.glob("*.py"):
        bad = {r for r in imported_roots(path) if r not in ALLOWED}
        assert not bad, f"{path.name} imports {sorted(bad)}"
