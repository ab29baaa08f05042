"""Base class of the self-validating, JSON-serializable option dataclasses every cache takes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

T = TypeVar("T", bound="CacheOptions")


@dataclasses.dataclass
class CacheOptions:
    """Subclasses add fields and override `validate`; unknown keys are rejected with the valid ones listed."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # pragma: no cover - overridden
        pass

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls: type[T], options: dict[str, Any]) -> T:
        unknown = sorted(set(options) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for {cls.__name__}; valid options: {cls.field_names()}")
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        return cls.from_dict(json.loads(text))


def parse_options_json(text: str, what: str) -> dict[str, Any]:
    """Cache options given as a JSON object string (command lines, lm-eval model args); `what` names them in the
    error, which says how to write them."""
    try:
        parsed = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{what} {text!r} is not valid JSON ({exc.msg} at character {exc.pos}); write a JSON object with double "
            'quotes around keys, e.g. \'{"dtype": "int4"}\''
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{what} must be a JSON object of cache options, got {text!r}")
    return parsed


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
