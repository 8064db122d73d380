"""Reading pickled checkpoints (composer .pt, pytorch_model.bin) without running any of their code.

torch.load(weights_only=True) only: each class or function that loader refuses (composer pickles
numpy RNG state, ...) is replaced by `_Inert`, which takes nothing from the file, so only tensors
and plain containers come out, and a note names what was dropped; a pickle that would call what
it built is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.errors import UserError

__all__ = ["load_pickle"]


class _Inert:
    """What a global the safe loader refuses stands for: built from any arguments and given any
    state, it keeps nothing."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _reason(exc: Exception) -> str:
    """The line of a torch.load error that says what it refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    marked = [i + 1 for i, line in enumerate(lines) if "WeightsUnpickler error" in line and i + 1 < len(lines)]
    return lines[marked[0]] if marked else lines[0] if lines else type(exc).__name__


def load_pickle(path: Path, hint: str) -> tuple[Any, list[str]]:
    """(torch.load(weights_only=True) of `path`, every global it refuses read as `_Inert`; the note,
    one line in a list, naming those globals, or no note); a file it cannot read (truncated, not a
    torch pickle, unsafe) is a UserError ending with `hint`."""
    try:
        refused = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        with torch.serialization.safe_globals([(_Inert, name) for name in refused]):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler raises many types
        raise UserError(
            f"cannot read {path} safely with torch.load(weights_only=True) ({_reason(exc)}); {hint}"
        ) from None
    notes = (
        [
            f"{path.name}: dropped the objects of globals torch.load(weights_only=True) refuses: "
            f"{', '.join(refused)} (nothing is read from them)"
        ]
        if refused
        else []
    )
    return loaded, notes
