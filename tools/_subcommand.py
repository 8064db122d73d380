"""What every tools/ script does: put this checkout on the path (as Megatron-LM's tools run from
a checkout without installing) and run one `setdiff` subcommand with the script's arguments."""

import sys
from pathlib import Path


def run(*subcommand: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from setdiff_megatron.cli import main

    return main([*subcommand, *sys.argv[1:]])
