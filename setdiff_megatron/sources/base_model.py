"""Where the base model of a Qwen3 SetDLM release is found (setdlm_release.py): its config names
a hub model, and there may be no hub, so every command that reads a model takes `--base DIR`, a
local copy; the command puts it in the environment, which the processes it starts inherit."""

from __future__ import annotations

import argparse

__all__ = ["BASE_ENV", "add_base_argument"]

BASE_ENV = "SETDIFF_BASE_MODEL"


def add_base_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base",
        default=None,
        metavar="DIR",
        help=f"a SetDLM release on Qwen3: a local copy of the base model its config names (its "
        f"config.json is enough); also read from ${BASE_ENV}",
    )
