"""Decoding settings as pydantic fields, made from their one declaration (sampling/decoding.py
SETTINGS): a recipe's `decoding` section, a sweep's settings and the server's request knobs are
all `settings_model`s, so a setting added there appears, with its range and help, at every door.

A field left out is unset (the model's own policy decides); `null` is a value and turns an
optional setting off. `given` reads back only what was set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, model_serializer

from setdiff_megatron.sampling.decoding import SETTINGS, Setting

__all__ = ["settings_model", "given", "DecodingSection"]


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


def given(model: BaseModel, names: Iterable[str] = SETTINGS) -> dict[str, Any]:
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
