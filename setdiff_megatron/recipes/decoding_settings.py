"""Decoding settings as pydantic fields, made from their one declaration (sampling/decoding.py
SETTINGS): a recipe's `decoding` section, a sweep's settings and the server's request knobs are
all `settings_model`s, so a setting added there appears, with its range and help, at every entry point.

A field left out is unset (the model's own policy decides); `null` is a value and turns an
optional setting off. `settings_given` reads back only what was set.

`with_stops` is the one way every entry point (sample jobs, the server, lm-eval, the showcase, RL
rollouts, the HF export) adds the tokenizer's EOS and stop texts to a DecodingConfig.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Annotated, Any, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_serializer

from setdiff_megatron.errors import UserError
from setdiff_megatron.sampling.decoding import SETTINGS, DecodingConfig, Setting

__all__ = ["settings_model", "settings_given", "DecodingSection", "with_stops"]


def _checker(setting: Setting):
    def check(value: Any) -> Any:
        if not setting.accepts(value):
            raise ValueError(f"must be {setting.allowed()}")
        return value

    return check


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def settings_model(
    model_name: str, names: Iterable[str] = SETTINGS, *, base: type[BaseModel] = _Strict, **extra: Any
) -> type[BaseModel]:
    """A pydantic model on `base` with one optional field per named setting, each checked by
    its declaration, plus the `extra` fields ((annotation, default) pairs)."""
    fields: dict[str, Any] = {
        key: (
            Annotated[SETTINGS[key].kind | None, AfterValidator(_checker(SETTINGS[key]))],
            Field(default=None, description=SETTINGS[key].help),
        )
        for key in names
    }
    return create_model(model_name, __base__=base, **fields, **extra)


def settings_given(model: BaseModel, names: Iterable[str] = SETTINGS) -> dict[str, Any]:
    """The settings `model` was given, by name (an explicit null included: it means off)."""
    return {key: getattr(model, key) for key in names if key in model.model_fields_set}


class _GivenOnly(BaseModel):
    """Dumps only the keys it was given, so a saved recipe reads back with the same unset keys."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {key: value for key, value in handler(self).items() if key in self.model_fields_set}


DecodingSection = settings_model("DecodingSection", base=_GivenOnly)
"""A recipe's `decoding`: the model's policy where it departs from its order's paper default
(core/orders.py `decoding_policy`), e.g. `decoding: {window: 8, threshold: 0.7}`."""


class _Tokenizer(Protocol):
    eos_id: int
    mask_id: int

    def encode(self, text: str) -> list[int]: ...


def with_stops(
    cfg: DecodingConfig,
    tokenizer: _Tokenizer,
    texts: Iterable[str] = (),
    *,
    eos: bool = True,
    skip_unusable: bool = False,
) -> DecodingConfig:
    """`cfg` stopping at the tokenizer's EOS and at `texts`.

    With `eos`, a config without EOS ids gets the tokenizer's; the texts' encodings follow the
    config's own stop sequences. A text that encodes to nothing or holds the MASK token is an
    error, or left out with `skip_unusable` (a request's or a task's stop strings)."""
    stops = cfg.stop_sequences
    for text in texts:
        seq = tuple(tokenizer.encode(text))
        if seq and tokenizer.mask_id not in seq:
            stops += (seq,)
        elif not skip_unusable:
            raise UserError(f"stop sequence {text!r} encodes to no token or holds MASK: give another stop string")
    eos_ids = cfg.eos_token_ids or ((tokenizer.eos_id,) if eos else ())
    return replace(cfg, eos_token_ids=eos_ids, stop_sequences=stops)
