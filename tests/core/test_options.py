"""Every option of every cache rejects a wrong value with a ValueError that names the option (and so the fix), and
every cache's options survive a JSON round trip. The fields are read from the option dataclasses, so an option added
later is covered without touching this file."""

from __future__ import annotations

import dataclasses

import pytest

import hf_kvcache  # noqa: F401  (registers every cache)
from hf_kvcache.options import CacheOptions


def _option_classes() -> list[type[CacheOptions]]:
    seen, todo = [], list(CacheOptions.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.__name__)


def _cases():
    for cls in _option_classes():
        for f in dataclasses.fields(cls):
            yield pytest.param(cls, f.name, id=f"{cls.__name__}.{f.name}")


def _wrong_values(cls: type[CacheOptions], name: str) -> list:
    """Values no option should take: the wrong kind for its default, or a word that is no valid choice."""
    default = getattr(cls(), name)
    if isinstance(default, bool):
        return ["yes", 2]
    if isinstance(default, (int, float)):
        return ["many", -7, float("nan")]
    if isinstance(default, str):
        return ["not-a-choice", 3]
    return ["not-a-choice", -7]


def test_every_option_class_is_found():
    names = {c.__name__ for c in _option_classes()}
    assert {"TieredQuantOptions", "KIVIOptions", "EvictOptions", "CPACOptions"} <= names, names


@pytest.mark.parametrize("cls,name", list(_cases()))
def test_wrong_value_names_the_option(cls, name):
    for value in _wrong_values(cls, name):
        with pytest.raises(ValueError, match=name):
            cls(**{name: value})


@pytest.mark.parametrize("cls", _option_classes(), ids=lambda c: c.__name__)
def test_defaults_round_trip_through_json(cls):
    opts = cls()
    assert cls.from_json(opts.to_json()) == opts
    with pytest.raises(ValueError, match="valid options"):
        cls.from_dict({"no_such_option": 1})
