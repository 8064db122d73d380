"""Every document the repository cites is in the repository.

Scanned: the .py, .md, .yaml and .sh files of the checkout (not .git, caches, build outputs or
run directories). Checked, precisely enough to have no false positives on prose:
- a mention of `docs/<page>.md` names a page that exists, and a section cited with it, as in
  (docs/method.md, "Loss") or docs/method.md#loss, is a heading of that page;
- a relative link target of a markdown file ([text](path), ![alt](path), [label]: path) exists,
  relative to the file, and its #anchor is a heading of the target;
- a markdown page that names a source file by its path from the root (setdiff_megatron/...,
  tests/..., benchmarks/..., tools/..., slurm/...) names one that exists;
- notes kept outside the repository are never cited (their names are in OUTSIDE).
URLs, code spans and fenced code blocks of markdown files are not link targets.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".sh"}
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".venv", "venv", "build", "dist", "node_modules"}
SKIP_TOP = {"runs", "outputs"}
"""Run outputs at the top of the checkout (ignored by git)."""
OUTSIDE = ("ALGORITHM", "MEGATRON_CPU", "KERNELS", "DESIGN")
"""Notes that live outside the repository; citing them (NAME.md) is an error wherever it happens."""
OUTSIDE_PHRASE = " ".join(("DESIGN", "in", "README"))
"""An old way of citing the design notes (spelled in parts so that this file does not cite it)."""

OUTSIDE_RE = re.compile(rf"\b(?:{'|'.join(OUTSIDE)})\.md\b|\b{OUTSIDE_PHRASE}\b")
DOCS_RE = re.compile(r"(?<![\w./-])(docs/[\w-]+(?:/[\w-]+)*\.md)(#[\w-]+)?(?:\s*,\s*\"([^\"]{1,80})\")?")
WRAP_RE = re.compile(r"\s*\n\s*(?:#+\s*)?")
"""A line break inside a quoted section name, with the comment marker of the next line."""
PATH_RE = re.compile(r"(?<![\w./-])((?:setdiff_megatron|tests|benchmarks|tools|slurm)/[\w./-]*\.(?:py|sh|sbatch|md))\b")
"""A path from the repository root to a source file, as the markdown pages name them."""
LINK_RE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
REF_DEF_RE = re.compile(r"^[ ]{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE_RE = re.compile(r"^[ ]{0,3}(```|~~~).*?^[ ]{0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN_RE = re.compile(r"`[^`\n]*`")
HEADING_RE = re.compile(r"^[ ]{0,3}#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
HTML_ANCHOR_RE = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@cache
def scanned_files() -> tuple[Path, ...]:
    out = []
    for here, dirs, files in os.walk(ROOT):
        top = Path(here) == ROOT
        dirs[:] = [
            d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info") and not (top and d in SKIP_TOP)
        ]
        out += [Path(here) / f for f in files if Path(f).suffix in SUFFIXES]
    return tuple(sorted(out))


@cache
def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _blank(match: re.Match) -> str:
    """The match as spaces, its newlines kept (so offsets and line numbers stay right)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def without_fences(markdown: str) -> str:
    return FENCE_RE.sub(_blank, markdown)


def without_code(markdown: str) -> str:
    """Fenced blocks and code spans blanked out."""
    return CODE_SPAN_RE.sub(_blank, without_fences(markdown))


def plain_heading(text: str) -> str:
    """A heading's text as rendered: link text for links, no code or emphasis markers."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[`*]", "", text).strip()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", plain_heading(heading).lower()).replace(" ", "-")


@cache
def headings(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(heading texts, anchors) of a markdown file; repeated headings get -1, -2, ... as on GitHub."""
    found = HEADING_RE.findall(without_fences(text_of(path)))
    anchors, seen = set(HTML_ANCHOR_RE.findall(text_of(path))), {}
    for heading in found:
        base = slug(heading)
        anchors.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return frozenset(plain_heading(h) for h in found), frozenset(anchors)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def where(path: Path, text: str, offset: int) -> str:
    return f"{path.relative_to(ROOT)}:{line_of(text, offset)}"


def test_no_document_outside_the_repository_is_cited():
    problems = []
    for path in scanned_files():
        text = text_of(path)
        if not any(f"{name}.md" in text for name in OUTSIDE) and OUTSIDE_PHRASE not in text:
            continue  # a plain search first: the regex is slow
        problems += [
            f"{where(path, text, m.start())}: {m.group(0)} is not in the repository; cite a docs/ page"
            for m in OUTSIDE_RE.finditer(text)
        ]
    assert not problems, "\n".join(problems)


def test_docs_pages_and_sections_that_are_mentioned_exist():
    problems = []
    for path in scanned_files():
        text = text_of(path)
        if "docs/" not in text:
            continue
        for m in DOCS_RE.finditer(text):
            page, section = ROOT / m.group(1), m.group(3) and WRAP_RE.sub(" ", m.group(3)).strip()
            problem = target_problem(page, (m.group(2) or "#")[1:])
            if problem is None and section and section not in headings(page)[0]:
                problem = f'has no section "{section}"'
            if problem:
                problems.append(f"{where(path, text, m.start())}: {m.group(1)} {problem}")
    assert not problems, "\n".join(problems)


def target_problem(page: Path, anchor: str) -> str | None:
    """Why `page` (with `#anchor`, if any) does not resolve, or None."""
    if not page.exists():
        return "does not exist"
    if anchor and page.suffix == ".md" and anchor not in headings(page)[1]:
        return f"has no heading #{anchor}"
    return None


def test_relative_markdown_links_resolve():
    problems = []
    for path in scanned_files():
        if path.suffix != ".md":
            continue
        text = without_code(text_of(path))
        targets = [(m.start(), m.group(1)) for m in LINK_RE.finditer(text)]
        targets += [(m.start(), m.group(1)) for m in REF_DEF_RE.finditer(text)]
        for offset, target in targets:
            if SCHEME_RE.match(target) or target.startswith("//"):
                continue  # a URL (http:, mailto:, ...)
            file_part, _, anchor = target.partition("#")
            base = ROOT if file_part.startswith("/") else path.parent
            problem = target_problem((base / file_part.lstrip("/")).resolve() if file_part else path, anchor)
            if problem:
                problems.append(f"{where(path, text, offset)}: link target {target} {problem}")
    assert not problems, "\n".join(problems)


def test_source_paths_named_in_markdown_exist():
    problems = []
    for path in scanned_files():
        if path.suffix != ".md":
            continue
        text = text_of(path)
        problems += [
            f"{where(path, text, m.start())}: {m.group(1)} does not exist"
            for m in PATH_RE.finditer(text)
            if not (ROOT / m.group(1)).exists()
        ]
    assert not problems, "\n".join(problems)


PACKAGE = ROOT / "setdiff_megatron"
MODULE_PATH_RE = re.compile(
    rf"(?<![\w./-])((?:{'|'.join(sorted(p.name for p in PACKAGE.iterdir() if (p / '__init__.py').is_file()))})"
    r"/[\w/]*\.py)\b"
)
"""A module named by its path inside the package (core/loss.py), as docstrings and pages name them."""


def test_module_paths_named_inside_the_package_exist():
    """A renamed or moved module leaves no docstring, comment or page pointing at its old path."""
    problems = []
    for path in scanned_files():
        text = text_of(path)
        problems += [
            f"{where(path, text, m.start())}: {m.group(1)} is not a module of setdiff_megatron/"
            for m in MODULE_PATH_RE.finditer(text)
            if not (PACKAGE / m.group(1)).exists() and not (ROOT / m.group(1)).exists()
        ]
    assert not problems, "\n".join(problems)
