"""Every pip extra installs as the README and the error messages spell it.

pip before 23.3 compares a requested extra with the package's metadata literally, and
setuptools writes the metadata's extras normalised (`lm_eval` becomes `lm-eval`): an extra
spelled otherwise than its normalised name installs nothing, with only a warning. So every
spelling must be a normalised name the metadata provides, and a fresh environment's pip must
accept each one.
"""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def spelled_extras() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    names = {
        n for group in re.findall(r"(?:setdiff-megatron|\.)\[([A-Za-z0-9_,-]+)\]", readme) for n in group.split(",")
    }
    for path in (ROOT / "setdiff_megatron").rglob("*.py"):
        names |= set(re.findall(r'require\("[^"]+", "([^"]+)"', path.read_text()))
    from setdiff_megatron.recipes.validation import ENGINE_EXTRAS

    return names | {extra for _, extra in ENGINE_EXTRAS.values()}


def test_every_spelled_extra_is_a_provided_normalised_name():
    provided = set(importlib.metadata.metadata("setdiff-megatron").get_all("Provides-Extra"))
    spelled = spelled_extras()
    assert {"dev", "lm-eval", "deepspeed", "hf"} <= spelled
    assert spelled <= provided, f"spelled but not provided (or not normalised): {sorted(spelled - provided)}"


def test_a_fresh_environments_pip_accepts_every_spelling(tmp_path):
    """Offline: the venv sees this installation through its system site-packages, so pip only
    matches the extras (an unknown one is a warning: 'does not provide the extra')."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp_path / "venv")], check=True)
    extras = ",".join(sorted(spelled_extras()))
    out = subprocess.run(
        [
            str(tmp_path / "venv" / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--disable-pip-version-check",
            f"setdiff-megatron[{extras}]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "does not provide the extra" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert "setdiff-megatron" in out.stdout + out.stderr
