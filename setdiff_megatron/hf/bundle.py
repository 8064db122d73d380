"""Generate the self-contained `modeling_setdiff.py` of a Hugging Face export from the package's
own modules, so that the exported model and sampler are the trained ones, never a hand copy.

From the root modules (`MODELING_ROOTS`) the bundler follows every `setdiff_megatron.*` import,
orders the modules so that each comes after those it imports at module level, and concatenates
their sources with the package imports removed. What may remain is what `trust_remote_code`
loading allows: the standard library, torch, transformers, relative imports of sibling files, and
optional GPU libraries imported inside functions, in try blocks (docs/huggingface.md, "Hugging
Face").
What cannot be bundled safely is a BundleError, never a silently broken file.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import sys
import tokenize
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BundleError", "bundle_modules", "modeling_source", "external_imports", "ALLOWED_IMPORTS"]

ALLOWED_IMPORTS = frozenset({"torch", "transformers"}) | frozenset(sys.stdlib_module_names)
"""Top-level packages an exported modeling file may import outside a try block."""
MODELING_ROOTS = (
    "setdiff_megatron.models.torch_model",
    "setdiff_megatron.sampling.sampler",
    "setdiff_megatron.hf.hf_model",
)
SIBLINGS = {"setdiff_megatron.hf.configuration_setdiff": "configuration_setdiff"}
"""Package modules shipped as their own file beside the modeling file (imported relatively)."""


class BundleError(Exception):
    """The sources cannot be bundled into a self-contained file (names the module and line)."""


@dataclass
class _Import:
    node: ast.Import | ast.ImportFrom
    target: str | None  # the package module imported from, or None for external imports
    lazy: bool  # inside a function body
    guarded: bool  # inside a try block


@dataclass
class _Module:
    name: str
    path: Path
    source: str
    tree: ast.Module = field(init=False)
    imports: list[_Import] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.source, str(self.path))

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _root(name: str) -> str:
    return name.split(".")[0]


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _load(name: str) -> _Module:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise BundleError(f"cannot find the source of module {name}")
    path = Path(spec.origin)
    module = _Module(name, path, path.read_text(encoding="utf-8"))
    _collect_imports(module, package=_root(name), is_package=path.name == "__init__.py")
    return module


def _collect_imports(module: _Module, *, package: str, is_package: bool) -> None:
    def visit(node: ast.AST, lazy: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if isinstance(child, ast.ImportFrom):
                    names = [_resolve(child, module.name, is_package)]
                else:
                    names = [a.name for a in child.names]
                inside = [n for n in names if _root(n) == package]
                if inside and len(names) > 1:
                    raise BundleError(f"{module.path}:{child.lineno}: import package modules one statement each")
                module.imports.append(_Import(child, inside[0] if inside else None, lazy, guarded))
            else:
                visit(
                    child,
                    lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                    guarded or isinstance(child, ast.Try),
                )

    visit(module.tree, False, False)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _optional(imp: _Import) -> bool:
    """An external import the bundle must mark optional (a function-level import outside a try
    block of a library other than torch/transformers/stdlib)."""
    node = imp.node
    roots = [_root(a.name) for a in node.names] if isinstance(node, ast.Import) else [_root(node.module or "")]
    return imp.lazy and not imp.guarded and any(r not in ALLOWED_IMPORTS for r in roots)


def _external_problem(module: _Module, imp: _Import) -> str | None:
    """Why an external import cannot stay in the bundle, or None."""
    node = imp.node
    roots = [_root(a.name) for a in node.names] if isinstance(node, ast.Import) else [_root(node.module or "")]
    bad = [r for r in roots if r not in ALLOWED_IMPORTS]
    if bad and not imp.guarded and not imp.lazy:
        return (
            f"{module.path}:{node.lineno} imports {', '.join(bad)} at module level; the Hugging Face "
            "export may only import torch, transformers and the standard library there (import optional "
            "libraries inside the functions that use them)"
        )
    return None


class _Bundler:
    def __init__(self, roots: Sequence[str], siblings: Mapping[str, str]):
        self.siblings = dict(siblings)
        self.modules: dict[str, _Module] = {}
        self.excluded: dict[str, str] = {}  # lazily imported modules left out, and why
        self.roots = list(roots)
        for root in roots:
            self._include(root, via=None)

    def _bundleable(self, name: str, seen: frozenset[str] = frozenset()) -> str | None:
        """Why module `name` (and its module-level package imports) cannot be bundled, or None.
        A lazily imported module that cannot be is left out, and its import becomes
        `raise ImportError(...)`, which a caller guarding it with `try/except ImportError` handles
        as a missing library."""
        if name in self.modules or name in seen or name in self.siblings:
            return None
        try:
            module = _load(name)
        except BundleError as exc:
            return str(exc)
        for imp in module.imports:
            if imp.lazy:
                continue
            if imp.target is None:
                problem = _external_problem(module, imp)
            else:
                problem = self._bundleable(imp.target, seen | {name})
            if problem:
                return problem
        return None

    def _include(self, name: str, via: str | None) -> None:
        if name in self.modules or name in self.siblings:
            return
        module = _load(name)
        self.modules[name] = module
        for imp in module.imports:
            if imp.target is None:
                problem = _external_problem(module, imp)
                if problem:
                    raise BundleError(problem)
                continue
            if imp.target in self.siblings:
                continue
            if isinstance(imp.node, ast.Import) and imp.node.names[0].asname is None:
                raise BundleError(
                    f"{module.path}:{imp.node.lineno}: `import {imp.target}` cannot be bundled; "
                    "use `import ... as name` or `from module import name`"
                )
            for target in _targets(imp):
                if imp.lazy:
                    problem = self._bundleable(target)
                    if problem:
                        self.excluded[target] = problem
                        continue
                self._include(target, via=name)

    # -- ordering and renaming -----------------------------------------------------------------
    def view(self, target: str, renames: Mapping[str, str]) -> str:
        """The expression standing for package module `target` used as an object (`from
        pkg.kernels import te_fused`; `te_fused.te_status()`): a `_BundledModule` whose attributes
        read the names that module defined in the bundle."""
        module = self.modules[target]
        names = {n for n, _ in _top_level_bindings(module)}
        names |= {
            a.asname or a.name
            for imp in module.imports
            if not imp.lazy and imp.target and isinstance(imp.node, ast.ImportFrom)
            for a in imp.node.names
        }
        mapping = {n: renames.get(n, n) for n in sorted(names)}
        return f"_BundledModule({target!r}, {mapping!r})"

    def order(self) -> list[_Module]:
        """Modules after the ones they import at module level; roots as late as possible."""
        done: list[str] = []

        def visit(name: str, stack: tuple[str, ...]) -> None:
            if name in done:
                return
            if name in stack:
                raise BundleError(f"circular module-level imports: {' -> '.join(stack + (name,))}")
            for imp in self.modules[name].imports:
                for target in _targets(imp) if not imp.lazy and imp.target else ():
                    if target in self.modules:
                        visit(target, stack + (name,))
            done.append(name)

        for name in sorted(
            self.modules, key=lambda n: (n in self.roots, self.roots.index(n) if n in self.roots else 0, n)
        ):
            visit(name, ())
        return [self.modules[n] for n in done]

    def renames(self) -> dict[str, dict[str, str]]:
        """{module: {old: new}} for top-level names that two bundled modules bind differently
        (torch_model.Block and orders.Block): each becomes `<module>_<name>` in its module and
        wherever it is imported; two different external imports under one name are a BundleError."""
        bindings: dict[str, dict[tuple, list[str]]] = {}
        for module in self.modules.values():
            for name, identity in _top_level_bindings(module):
                bindings.setdefault(name, {}).setdefault(identity, []).append(module.name)
        out: dict[str, dict[str, str]] = {}
        for name, identities in bindings.items():
            if len(identities) < 2:
                continue
            externals = [i for i in identities if i[0] == "import"]
            if len(externals) > 1:
                raise BundleError(
                    f"modules bind {name!r} to different imports: "
                    + "; ".join(f"{i[1]} in {', '.join(m)}" for i, m in identities.items())
                )
            for identity, modules in identities.items():
                if identity[0] == "import":
                    continue
                (owner,) = modules
                new = f"{self.modules[owner].short}_{name}"
                out.setdefault(owner, {})[name] = new
                for module in self.modules.values():  # importers of the renamed name
                    for imp in module.imports:
                        if imp.target == owner and isinstance(imp.node, ast.ImportFrom):
                            if any(a.name == name and a.asname is None for a in imp.node.names):
                                out.setdefault(module.name, {})[name] = new
        return out


def _top_level_bindings(module: _Module) -> list[tuple[str, tuple]]:
    """(name, identity) of the names a module binds at top level; package imports bind nothing new."""
    out = []
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.name, ("def", module.name)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name) and n.id != "__all__":
                        out.append((n.id, ("def", module.name)))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _root(a.name) != _root(module.name):
                    out.append((a.asname or a.name.split(".")[0], ("import", a.name if a.asname else _root(a.name))))
                else:
                    out.append((a.asname, ("module", a.name)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _root(node.module or "") != _root(module.name):
            if node.module != "__future__":
                out += [(a.asname or a.name, ("import", f"{node.module}.{a.name}")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [
                (a.asname or a.name, ("module", f"{node.module}.{a.name}"))
                for a in node.names
                if _is_module(f"{_resolve(node, module.name, module.path.name == '__init__.py')}.{a.name}")
            ]
    return out


def _targets(imp: _Import) -> list[str]:
    """The package modules an import statement needs: submodules imported as objects, else its module."""
    if isinstance(imp.node, ast.Import):
        return [imp.target]
    subs = [f"{imp.target}.{a.name}" for a in imp.node.names if _is_module(f"{imp.target}.{a.name}")]
    if subs and len(subs) < len(imp.node.names):
        return [imp.target, *subs]
    return subs or [imp.target]


def _rename_tokens(module: _Module, renames: Mapping[str, str]) -> str:
    """`module`'s source with every reference to the renamed top-level names renamed. Renaming is
    token based, so a renamed name used inside an f-string is a BundleError, never a silently
    broken file."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.JoinedStr) and any(isinstance(n, ast.Name) and n.id in renames for n in ast.walk(node)):
            raise BundleError(f"{module.path}:{node.lineno}: cannot rename {sorted(renames)} inside an f-string")
    lines = module.source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, str]] = []
    # Package imports are rewritten from their own names (see _transform), never renamed here.
    skip = {row for imp in module.imports if imp.target for row in range(imp.node.lineno, imp.node.end_lineno + 1)}
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(module.source).readline)
        if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    ]
    depth = 0
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if tok.type != tokenize.NAME or tok.string not in renames or tok.start[0] in skip:
            continue
        prev = tokens[i - 1].string if i else ""
        nxt = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if prev == "." or (depth > 0 and nxt == "=" and prev in ("(", ",")):  # attribute or keyword argument
            continue
        (row, col), (_, end) = tok.start, tok.end
        edits.append((row, col, end, renames[tok.string]))
    for row, col, end, new in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[end:]
    return "".join(lines)


def _statement_lines(lines: list[str], node: ast.stmt, path: Path) -> tuple[int, int, str]:
    """(first, last + 1) line indices of a statement that has its lines to itself, and its indent."""
    first, last = node.lineno - 1, node.end_lineno
    indent = lines[first][: node.col_offset]
    after = lines[last - 1][node.end_col_offset :].strip()
    if indent.strip() or (after and not after.startswith("#")):
        raise BundleError(f"{path}:{node.lineno}: put package imports on lines of their own")
    return first, last, indent


def _transform(module: _Module, bundler: _Bundler, renames: Mapping[str, Mapping[str, str]], keep_all: bool) -> str:
    """`module`'s source as it goes into the bundle: its names renamed, package imports removed
    (a `from m import a as b` leaves `b = a`), sibling imports made relative, optional imports
    wrapped in try blocks, and `__all__` dropped unless `keep_all`."""
    own = renames.get(module.name, {})
    source = _rename_tokens(module, own) if own else module.source
    renamed = _Module(module.name, module.path, source)
    _collect_imports(renamed, package=_root(module.name), is_package=module.path.name == "__init__.py")
    lines = source.splitlines(keepends=True)
    replace: list[tuple[int, int, list[str]]] = []
    optional: list[tuple[int, int, str]] = []

    def left_out(target: str, indent: str) -> list[str]:
        reason = bundler.excluded[target].splitlines()[0]
        return [f"{indent}raise ImportError({f'{target} is not part of the Hugging Face export ({reason})'!r})\n"]

    for imp in renamed.imports:
        node = imp.node
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            replace.append((*_statement_lines(lines, node, module.path)[:2], []))
            continue
        first, last, indent = (
            _statement_lines(lines, node, module.path) if (imp.target or _optional(imp)) else (0, 0, "")
        )
        if imp.target is None:
            if _optional(imp):
                optional.append((first, last, indent))
            continue
        if imp.target in bundler.siblings:
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            replace.append((first, last, [f"{indent}from .{bundler.siblings[imp.target]} import {names}\n"]))
            continue
        new: list[str] = []
        if isinstance(node, ast.Import):
            alias = node.names[0]
            new = (
                left_out(imp.target, indent)
                if imp.target in bundler.excluded
                else [f"{indent}{alias.asname} = {bundler.view(imp.target, renames.get(imp.target, {}))}\n"]
            )
        else:
            for a in node.names:
                sub = f"{imp.target}.{a.name}"
                if sub in bundler.excluded or (sub not in bundler.modules and imp.target in bundler.excluded):
                    new = left_out(sub if sub in bundler.excluded else imp.target, indent)
                    break
                if sub in bundler.modules:
                    new.append(f"{indent}{a.asname or a.name} = {bundler.view(sub, renames.get(sub, {}))}\n")
                elif a.asname:
                    new.append(f"{indent}{a.asname} = {renames.get(imp.target, {}).get(a.name, a.name)}\n")
        if not new and imp.lazy:
            new = [f"{indent}pass\n"]
        replace.append((first, last, new))
    # Optional libraries imported where they are used: one try block per run of such imports, so
    # that Hugging Face's check_imports does not require them to load the file.
    for group in _runs(sorted(optional)):
        first, last, indent = group[0][0], group[-1][1], group[0][2]
        starts = {span[0] for span in group}
        body = [f"{indent}    {lines[i].lstrip()}" if i in starts else f"    {lines[i]}" for i in range(first, last)]
        replace.append(
            (
                first,
                last,
                [
                    f"{indent}try:  # optional: needed only where this code runs\n",
                    *body,
                    f"{indent}except ImportError:\n",
                    f"{indent}    raise\n",
                ],
            )
        )
    if not keep_all:
        for node in renamed.tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                replace.append((*_statement_lines(lines, node, module.path)[:2], []))
    for first, last, new in sorted(replace, reverse=True):
        lines[first:last] = new
    return "".join(lines).strip("\n") + "\n"


def _runs(spans: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """Adjacent line spans with the same indent, grouped."""
    groups: list[list[tuple[int, int, str]]] = []
    for span in spans:
        if groups and groups[-1][-1][1] == span[0] and groups[-1][-1][2] == span[2]:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


_VIEW_CLASS = '''

class _BundledModule:
    """A package module bundled into this file, used as an object: attributes read its names here."""

    def __init__(self, name, names):
        self.__name__, self._names = name, names

    def __getattr__(self, attr):
        try:
            return globals()[self._names[attr]]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}") from None
'''


def bundle_modules(roots: Sequence[str], *, siblings: Mapping[str, str] | None = None, header: str = "") -> str:
    """One Python source holding `roots` and every package module they need, package imports removed."""
    bundler = _Bundler(roots, siblings or {})
    renames = bundler.renames()
    ordered = bundler.order()
    parts = [header.rstrip("\n") + "\n" if header else "", "from __future__ import annotations\n"]
    if any(
        _targets(imp) != [imp.target] or isinstance(imp.node, ast.Import)
        for m in ordered
        for imp in m.imports
        if imp.target and imp.target not in bundler.siblings
    ):
        parts.append(_VIEW_CLASS)
    for module in ordered:
        rel = Path(*module.name.split(".")[:-1], module.path.name)
        if module.path.name == "__init__.py":
            rel = Path(*module.name.split("."), module.path.name)
        body = _transform(module, bundler, renames, keep_all=module is ordered[-1])
        parts.append(f"\n\n# {'-' * 30} {rel} {'-' * 30}\n\n{body}")
    if bundler.excluded:
        left_out = "".join(f"#   {name}: {why.splitlines()[0]}\n" for name, why in sorted(bundler.excluded.items()))
        parts.append(f"\n\n# Lazily imported modules left out of this file:\n{left_out}")
    text = "".join(parts)
    compile(text, "<bundle>", "exec")
    problems = [f"line {n.lineno}: {r}" for n, r in external_imports(text) if r not in ALLOWED_IMPORTS]
    if problems:
        raise BundleError(f"the bundle still imports packages outside torch/transformers: {problems}")
    return text


def external_imports(text: str) -> list[tuple[ast.stmt, str]]:
    """(statement, top-level package) of every absolute import outside a try block, as Hugging
    Face's `check_imports` sees them (it skips try blocks and relative imports)."""
    out = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Try):
                continue
            if isinstance(child, ast.Import):
                out.extend((child, _root(a.name)) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child, _root(child.module)))
            visit(child)

    visit(ast.parse(text))
    return out


def modeling_source(version: str = "") -> str:
    """The `modeling_setdiff.py` of a Hugging Face export."""
    header = (
        f'"""Set diffusion transformer and cached set sampler for Hugging Face transformers.\n\n'
        f"Generated by setdiff_megatron.hf.bundle from setdiff-megatron {version}: the package's own modules,\n"
        f"concatenated with its imports removed. Do not edit; re-export instead. Needs torch and transformers.\n"
        f'"""'
    )
    return bundle_modules(MODELING_ROOTS, siblings=SIBLINGS, header=header)
