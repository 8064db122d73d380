"""The figures README.md and docs/study.md cite as a mean and its spread ("0.709 ± 0.036") are
ones a committed result prints: each is found in the reports under benchmarks/results/ (each
generated from its committed results.json and tested against it: test_report.py,
test_claims.py), and one cited with its speed ("0.709 ± 0.036 at 2.70") is printed with that
speed, so a new run cannot leave an old figure behind in the prose."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
SPREAD = re.compile(r"[+-]?\d+\.\d+ ± \d+\.\d+")
AT_SPEED = re.compile(r"(\d+\.\d+ ± \d+\.\d+) at (\d+\.\d+)")


@pytest.fixture(scope="module")
def printed() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "benchmarks" / "results").rglob("*.md")))


@pytest.mark.parametrize("page", ["README.md", "docs/study.md"])
def test_every_cited_spread_is_printed_by_a_committed_result(page, printed):
    cited = SPREAD.findall((ROOT / page).read_text())
    assert len(cited) > 10  # the pages cite the study's figures this way
    orphans = sorted({f for f in cited if f not in printed and f.lstrip("+") not in printed})
    assert not orphans, f"{page} cites figures no committed result prints: {orphans}"


@pytest.mark.parametrize("page", ["README.md", "docs/study.md"])
def test_a_figure_cited_at_a_speed_is_printed_at_that_speed(page, printed):
    """The speed must follow the figure within the same printed entry (80 characters of its line):
    a claims row holds both sides' figures and speeds, and each figure goes with its own."""
    pairs = AT_SPEED.findall((ROOT / page).read_text())
    assert len(pairs) > 5
    unmatched = [
        f"{figure} at {speed}"
        for figure, speed in pairs
        if not re.search(re.escape(figure) + r"[^\n]{0,80}?\b" + re.escape(speed) + r"\b", printed)
    ]
    assert not unmatched, f"{page} cites figures at speeds no committed result prints them at: {unmatched}"
