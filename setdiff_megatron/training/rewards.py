"""Rewards of RL rollouts (recipe rl.reward): the reasoning corpus's answer match built in, or a
function of the user's, `module:function`, called as function(record, completion) -> float with
the record's prompt and reference texts and the completion's text."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from setdiff_megatron.data.answers import gsm8k_answer
from setdiff_megatron.errors import UserError

__all__ = ["Reward", "reward_function"]

Reward = Callable[[dict, str], float]


def gsm8k_reward(record: dict, completion: str) -> float:
    """1 when the completion's final answer (#### answer) is the reference's, else 0."""
    answer = gsm8k_answer(completion)
    return float(answer is not None and answer == gsm8k_answer(record["reference"]))


def reward_function(spec: str) -> Reward:
    """The reward `spec` names (rl.reward), refused in one line when it cannot be found."""
    if spec == "gsm8k":
        return gsm8k_reward
    module, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(
            f"rl.reward: cannot load {spec!r} ({exc}); give 'gsm8k' or an importable 'module:function'"
        ) from None
    if not callable(function):
        raise UserError(f"rl.reward: {spec!r} is not a function")
    return function
