"""The `setdiff` command as a new user meets it."""

import json
import subprocess
import sys

from setdiff_megatron import __version__
from setdiff_megatron.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "setdiff_megatron.cli", *args], capture_output=True, text=True)


def test_version_and_help():
    out = run_cli("--version")
    assert out.returncode == 0 and __version__ in out.stdout
    out = run_cli("--help")
    assert out.returncode == 0 and "train" in out.stdout


def test_preview_train_runs_and_saves(tmp_path, capsys):
    assert main(["train", "--steps", "2", "--out-dir", str(tmp_path)]) == 0
    log = json.loads((tmp_path / "log.json").read_text())
    assert len(log["train_loss"]) == 2 and (tmp_path / "model.pt").exists()
    assert "checkpoint:" in capsys.readouterr().out
