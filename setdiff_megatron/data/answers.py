"""The final answer of a GSM8K-style solution, as the built-in reasoning corpus writes it
(`#### answer`): shared by scoring (evaluation/scoring.py) and RL rewards (training/rewards.py)."""

from __future__ import annotations

import re

__all__ = ["gsm8k_answer"]

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _number(text: str) -> str:
    value = text.replace(",", "")
    return value.rstrip("0").rstrip(".") if "." in value else value


def gsm8k_answer(text: str) -> str | None:
    """The final number of a GSM8K-style solution: after '####' if present, else the last number."""
    final = _GSM8K_FINAL.search(text)
    if final:
        return _number(final.group(1))
    numbers = _NUMBER.findall(text)
    return _number(numbers[-1]) if numbers else None
