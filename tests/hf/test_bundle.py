"""The generated modeling file: self-contained (stdlib, torch, transformers), built from the
package's own modules, and the bundler's rules on synthetic packages (renames, lazy imports,
optional libraries, modules used as objects)."""

from __future__ import annotations

import ast
import difflib
import sys
import textwrap
import types
from pathlib import Path

import pytest

from setdiff_megatron.hf.bundle import ALLOWED_IMPORTS, BundleError, bundle_modules, external_imports, modeling_source

CONFIG_FILE = Path(__file__).parents[2] / "setdiff_megatron" / "hf" / "configuration_setdiff.py"


@pytest.fixture(scope="module")
def modeling() -> str:
    return modeling_source("test")


def _inside_try(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a try block."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            out |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


def test_modeling_file_imports_only_stdlib_torch_transformers(modeling):
    tree = ast.parse(modeling)
    guarded = _inside_try(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.module == "configuration_setdiff", ast.unparse(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            assert not any(n.startswith("setdiff_megatron") for n in names), ast.unparse(node)
            roots = {n.split(".")[0] for n in names}
            assert roots <= ALLOWED_IMPORTS or id(node) in guarded, f"unguarded import: {ast.unparse(node)}"
    # what Hugging Face's check_imports will demand when the model is loaded
    assert {root for _, root in external_imports(modeling)} <= {"torch", "transformers"} | set(sys.stdlib_module_names)
    config_roots = {root for _, root in external_imports(CONFIG_FILE.read_text())}
    assert config_roots == {"transformers"}


def test_modeling_file_is_the_package_source(modeling):
    """Built from the modules themselves: the model and its mixture of experts, the sampler,
    decoding, the cache, the attention kernels (optional GPU imports kept, guarded) and the HF
    wrapper."""
    for module in (
        "models/torch_model.py",
        "models/moe.py",
        "sampling/sampler.py",
        "sampling/decoding.py",
        "sampling/kv_cache.py",
        "core/attention.py",
        "core/attention_shapes.py",
        "core/merged_attention.py",
        "core/document_attention.py",
        "core/step_attention.py",
        "hf/hf_model.py",
    ):
        assert f" setdiff_megatron/{module} " in modeling
    again = modeling_source("test")
    assert modeling == again, "\n".join(list(difflib.unified_diff(modeling.splitlines(), again.splitlines()))[:20])
    assert "class SetDiffModel(SetDiffPreTrainedModel)" in modeling
    ns = _run(
        modeling.replace("from .configuration_setdiff import", "from setdiff_megatron.hf.configuration_setdiff import")
    )
    # two modules define `Block` (orders, torch_model): both survive, renamed apart
    assert {"orders_Block", "torch_model_Block", "SetDiffusionTransformer", "SetSampler", "DecodingConfig"} <= set(ns)


def _package(tmp_path: Path, files: dict[str, str]) -> str:
    name = f"fakepkg_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    for rel, text in files.items():
        (root / rel).write_text(textwrap.dedent(text).replace("PKG", name))
    sys.path.insert(0, str(tmp_path))
    return name


def _run(text: str) -> dict:
    """Execute a bundle as a module of its own (dataclasses look their module up in sys.modules)."""
    module = types.ModuleType(f"bundled_{len(sys.modules)}")
    sys.modules[module.__name__] = module
    exec(compile(text, "<bundle>", "exec"), module.__dict__)
    return module.__dict__


def test_bundler_renames_collisions_and_bundles_lazy_kernels(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "a.py": """
            import torch

            class Block:
                kind = "a"

            def make():
                return Block()
            """,
            "kern.py": """
            def status():
                try:
                    import fake_gpu_library_one  # noqa: F401
                except ImportError:
                    return "fallback"
                return "gpu"

            def load():
                import fake_gpu_library_two  # function-level: bundled, marked optional
                return fake_gpu_library_two
            """,
            "gpu.py": """
            import fake_gpu_library_three  # module level: this module cannot be bundled

            def fast():
                return "fast"
            """,
            "b.py": """
            from PKG import kern
            from PKG.a import Block as ABlock, make

            class Block:
                kind = "b"

            def both():
                return ABlock.kind, Block.kind, make().kind, kern.status()

            def fast_or_slow():
                try:
                    from PKG.gpu import fast
                except ImportError:
                    return "slow"
                return fast()
            """,
        },
    )
    text = bundle_modules([f"{pkg}.b"])
    ns = _run(text)
    assert ns["both"]() == ("a", "b", "a", "fallback")
    assert ns["fast_or_slow"]() == "slow"  # gpu.py left out: its import raises ImportError
    assert "def fast()" not in text and f"#   {pkg}.gpu: " in text  # left out, and said so
    with pytest.raises(ImportError):
        ns["load"]()
    # the function-level import of an optional library is inside a try block (HF's check skips it)
    assert {root for _, root in external_imports(text)} == {"__future__", "torch"}


def test_bundler_refuses_module_level_third_party_imports(tmp_path):
    pkg = _package(tmp_path, {"m.py": "import numpy\n\nX = 1\n", "root.py": "from PKG.m import X\n\nY = X + 1\n"})
    with pytest.raises(BundleError, match="imports numpy at module level"):
        bundle_modules([f"{pkg}.root"])
