"""User-facing errors: anything a user can fix raises `UserError`, which is reported on one line.

The `setdiff` command prints a UserError's message without a traceback and exits with code 2; a
command line that does not parse gets one line and the same code (`ArgumentParser`). Programming
errors keep their tracebacks. Under the local launcher each worker hands its message over in a
file of its rank (`report`), the launcher prints the lowest rank's once (`handed_over`), and a
peer's failure that follows stays quiet (`run_reporting`; see the top of docs/training.md).
"""

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from setdiff_megatron.log import say

EXIT_USER_ERROR = 2
# Where the local launcher's workers leave their UserError messages, one file a rank: every rank
# may meet the same error (a collective check refuses on all of them), and one line is shown.
ERROR_DIR_ENV = "SETDIFF_ERROR_DIR"


class UserError(Exception):
    """An error in the user's input or environment, reported as one line with exit code 2."""


class MissingExtraError(UserError):
    """An optional dependency is not installed; the message names the pip extra to add."""

    def __init__(self, package: str, extra: str, purpose: str):
        super().__init__(f"{purpose} needs the '{package}' package: pip install 'setdiff-megatron[{extra}]'")
        self.package = package
        self.extra = extra


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency or raise MissingExtraError naming the extra.

    Catches every exception, not only ImportError: a half-installed Transformer Engine raises
    RuntimeError on import.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - see docstring
        raise MissingExtraError(module.split(".")[0], extra, purpose) from exc


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its usage errors in one line: `PROG: error: what is wrong; see PROG
    --help`, exit code 2 (a UserError's), not the usage block above it. Subcommands' parsers are of
    this class too (argparse makes them of their parent's class). Every command line of the
    project (`setdiff`, its subcommands, `python -m benchmarks...`, the tools/ scripts) parses
    with it."""

    def __init__(self, *args, **kwargs):
        if not args and "prog" not in kwargs:
            kwargs["prog"] = _module_prog()
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {_type_error(message)}; see {self.prog} --help\n")


_TYPE_ERROR = re.compile(r"^(argument [^:]+): invalid (\w+) value: (.*)$")
_EXPECTED = {"int": "an integer", "float": "a number"}


def _type_error(message: str) -> str:
    """argparse's 'argument --x: invalid NAME value: 'v'' names the type converter, a function of
    ours for custom types: say what was expected instead (custom types raise ArgumentTypeError
    with their own words, which argparse passes through)."""
    match = _TYPE_ERROR.match(message)
    if match is None:
        return message
    flag, name, value = match.groups()
    return f"{flag}: expected {_EXPECTED[name]}, got {value}" if name in _EXPECTED else f"{flag}: invalid value {value}"


def _module_prog() -> str | None:
    """`python -m PACKAGE.MODULE` for a parser of a module run with -m (argparse would say
    `__main__.py` or the file name); None (argparse's choice) otherwise."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.origin or not sys.argv[0] or Path(sys.argv[0]).resolve() != Path(spec.origin).resolve():
        return None
    return f"python -m {spec.name.removesuffix('.__main__')}"


def run_reporting(main: Callable[[], int]) -> int:
    """`main()`'s exit code, or a UserError's (`report`). In a worker of the local launcher, any
    other failure after another rank handed over a UserError exits with code 1 and without its
    traceback: the person reads the one line that caused it, not a peer lost in a collective."""
    try:
        return main()
    except UserError as exc:
        return report(exc)
    except Exception:
        directory = os.environ.get(ERROR_DIR_ENV)
        if not directory or handed_over(Path(directory)) is None:
            raise
        return 1


def report(exc: UserError) -> int:
    """Show `exc` as one line on stderr, or, in a worker of the local launcher, leave it to the
    launcher (which shows one rank's message for all of them); returns the exit code."""
    directory = os.environ.get(ERROR_DIR_ENV)
    if directory:
        mine = Path(directory) / f"rank-{int(os.environ.get('RANK', '0')):06d}"
        partial = mine.with_name(f".{mine.name}")
        partial.write_text(str(exc))
        partial.replace(mine)  # whole or absent: the launcher may look at any moment
    else:
        say(f"setdiff: error: {exc}", file=sys.stderr, everywhere=True)
    return EXIT_USER_ERROR


def handed_over(directory: Path) -> str | None:
    """The message the lowest rank that met a UserError left in `directory`, or None."""
    messages = sorted(Path(directory).glob("rank-*"))
    return messages[0].read_text() if messages else None
