"""EOS and stop sequences reach a DecodingConfig one way (recipes/decoding_settings.py `with_stops`), at every entry point."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes.decoding_settings import with_stops
from setdiff_megatron.sampling.decoding import DecodingConfig

PACKAGE = Path(__file__).parents[2] / "setdiff_megatron"
ENTRY_POINTS = (
    "inference/job.py",
    "serving/app.py",
    "evaluation/lm_eval_adapter.py",
    "evaluation/showcase.py",
    "training/rollouts.py",
    "hf/export.py",
)
"""Every place a decode is asked for that stops at EOS or at stop texts."""
STOP_FIELDS = {"eos_token_ids", "stop_sequences"}
ENGINE = {"core", "sampling"}
"""The decoding engine (its declaration, and a warm-up that decodes without stops) is no entry point."""
MAY_SET = {"recipes/decoding_settings.py", "sources/hf_config.py", "sources/hf_export.py"}
"""Where else the fields may be written: `with_stops`, and the generation-config translation (an
export's EOS is left to the caller)."""


class Tok:
    eos_id, mask_id = 2, 3

    def encode(self, text: str) -> list[int]:
        return [{"<mask>": 3}.get(word, 10 + len(word)) for word in text.split()]


def test_with_stops_adds_eos_and_encoded_texts():
    cfg = with_stops(DecodingConfig(), Tok(), ["ab", "", "x <mask>", "abc d"], skip_unusable=True)
    assert cfg.eos_token_ids == (2,)
    assert cfg.stop_sequences == ((12,), (13, 11))
    for unusable in ("", "x <mask>"):  # a job's own stop strings: an error that says what to do
        with pytest.raises(UserError, match="give another stop string"):
            with_stops(DecodingConfig(), Tok(), ["ab", unusable])


def test_with_stops_keeps_the_configs_own():
    own = DecodingConfig(eos_token_ids=(7, 8), stop_sequences=((5, 5),))
    cfg = with_stops(own, Tok(), ["ab"])
    assert cfg.eos_token_ids == (7, 8)
    assert cfg.stop_sequences == ((5, 5), (12,))
    assert with_stops(DecodingConfig(), Tok(), eos=False).eos_token_ids == ()


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_every_entry_point_goes_through_with_stops(entry_point):
    tree = ast.parse((PACKAGE / entry_point).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "with_stops"]
    assert calls, f"{entry_point} decodes without with_stops"


def _writes(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            lines += [node.lineno for kw in node.keywords if kw.arg in STOP_FIELDS]
        elif isinstance(node, ast.Dict):
            lines += [node.lineno for k in node.keys if isinstance(k, ast.Constant) and k.value in STOP_FIELDS]
    return lines


def test_no_door_sets_eos_or_stops_by_hand():
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in ENGINE
        and str(path.relative_to(PACKAGE)) not in MAY_SET
        and (lines := _writes(ast.parse(path.read_text())))
    }
    assert not found, f"set eos_token_ids / stop_sequences through recipes/decoding_settings.py with_stops: {found}"
