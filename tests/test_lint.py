"""The lint and format gate (ruff.toml): the README's test command, and so CI, fails on a lint error or
an unformatted file. Fix with `ruff check --fix .` and `ruff format .` (ruff comes with the dev extra)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["check", "--output-format", "concise"], ["format", "--check"]])
def test_the_tree_passes_ruff(command):
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff {command[0]} failed:\n{done.stdout}{done.stderr}"
