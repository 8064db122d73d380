"""The figures README.md and docs/study.md cite as a mean and its spread ("0.709 ± 0.036") are
ones a committed result prints: each is found in the reports under benchmarks/results/ (each
generated from its committed results.json and tested against it: test_report.py,
test_claims.py), so a new run cannot leave an old figure behind in the prose."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
SPREAD = re.compile(r"[+-]?\d+\.\d+ ± \d+\.\d+")


@pytest.fixture(scope="module")
def printed() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "benchmarks" / "results").rglob("*.md")))


@pytest.mark.parametrize("page", ["README.md", "docs/study.md"])
def test_every_cited_spread_is_printed_by_a_committed_result(page, printed):
    cited = SPREAD.findall((ROOT / page).read_text())
    assert len(cited) > 10  # the pages cite the study's figures this way
    orphans = sorted({f for f in cited if f not in printed and f.lstrip("+") not in printed})
    assert not orphans, f"{page} cites figures no committed result prints: {orphans}"
