"""A Python without setdiff_megatron: torch, transformers and what they require, nothing else.

`python -S` skips site-packages (and so the editable install of this repository); PYTHONPATH
then holds one directory of symlinks to the distributions in the dependency closure of torch
and transformers (their packages and their .dist-info, which transformers' version checks read).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement


def _closure(roots: tuple[str, ...]) -> list[metadata.Distribution]:
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _top_level(dist: metadata.Distribution) -> set[str]:
    names = set()
    for f in dist.files or []:
        first = f.parts[0]
        if first.endswith((".dist-info", ".egg-info", ".data", ".pth")) or first in ("..", "__pycache__"):
            continue
        names.add(first)
    return names


def make_clean_site(dest: Path, roots: tuple[str, ...] = ("torch", "transformers")) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for dist in _closure(roots):
        base = Path(dist.locate_file(""))
        for name in _top_level(dist) | {Path(str(dist._path)).name}:  # noqa: SLF001 - the dist-info dir
            src = base / name
            if src.exists() and not (dest / name).exists():
                (dest / name).symlink_to(src)
    return dest


def run_clean(script: str, site: Path, workdir: Path, timeout: float = 300) -> dict:
    """Run `script` with `python -S` and only `site` on the path; it prints one JSON line last."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "clean_script.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env |= {
        "PYTHONPATH": str(site),
        "PYTHONNOUSERSITE": "1",
        "HF_HOME": str(workdir / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, "-S", str(path)], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"clean-environment script failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
