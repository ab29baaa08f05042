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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, allow_none: bool = False,
              hint: str = "") -> None:
    """`value` is an int in [lo, hi] (either bound may be open-ended), or None when `allow_none`."""
    if value is None and allow_none:
        return
    if _is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi):
        return
    if hi is not None:
        what = f"an integer in {lo}..{hi}"
    else:
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")
    raise ValueError(f"{name} must be {what}{hint}{' or None' if allow_none else ''}, got {value!r}")


def check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    check_int(name, value, lo=1, allow_none=allow_none)


def check_number(name: str, value: Any, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 hi_open: bool = False, allow_none: bool = False, hint: str = "") -> None:
    """`value` is an int or float within the bounds (open or closed), or None when `allow_none`."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if ok:
        return
    if lo is not None and hi is not None:
        what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        what = f"a number {'>' if lo_open else '>='} {lo:g}"
    else:
        what = f"a number {'<' if hi_open else '<='} {hi:g}" if hi is not None else "a number"
    raise ValueError(f"{name} must be {what}{hint}{' or None' if allow_none else ''}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
