"""docs/scaling.md's table of the paper's recipes is what `python -m setdiff_megatron.planning.table`
prints: three rows (two of the megatron engine, one of DeepSpeed) are planned again (slow: about 50
s) and must be on the page as printed."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_the_docs_table_is_the_commands_output():
    out = subprocess.run(
        [sys.executable, "-m", "setdiff_megatron.planning.table", "gsm8k-8", "gsm8k-8-zero2", "lm1b-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    page = (ROOT / "docs" / "scaling.md").read_text()
    rows = out.stdout.splitlines()
    assert len(rows) == 5
    for line in rows:
        assert line in page, line
