"""User-facing errors.

Anything a user can fix (a wrong path, a malformed recipe, a missing extra) raises `UserError`;
the `setdiff` command prints its message on one line and exits with code 2, without a traceback.
Programming errors keep their tracebacks.
"""


class UserError(Exception):
    """An error in the user's input or environment, reported as one line with exit code 2."""


class MissingExtraError(UserError):
    """An optional dependency is not installed; the message names the pip extra to add."""

    def __init__(self, package: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the '{package}' package: pip install 'setdiff-megatron[{extra}]'"
        )
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
