"""The `setdiff` command as a new user meets it."""

import subprocess
import sys

from setdiff_megatron import __version__


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "setdiff_megatron.cli", *args], capture_output=True, text=True)


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0 and __version__ in out.stdout
    out = run_cli("--help")
    assert out.returncode == 0 and "train" in out.stdout


def test_train_needs_a_recipe(capsys):
    out = run_cli("train")
    assert out.returncode == 2 and "recipe" in out.stderr
