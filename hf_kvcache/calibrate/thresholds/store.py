"""Thresholds per (model id, context length) (`ThresholdStore`) and their versioned JSON files."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterator, Mapping

from .values import Thresholds, _is_int

FORMAT = "hf-kvcache-thresholds"  # the files' format name and version
VERSION = 1


# ---- the store and files --------------------------------------------------------------------------------------------
def _check_key(model_id: Any, context_length: Any) -> None:
    if not isinstance(model_id, str) or not model_id:
        raise ValueError(f"model_id must be a non-empty string (e.g. 'smollm2-135m' or a hub id), got {model_id!r}")
    if not _is_int(context_length) or context_length <= 0:
        raise ValueError(f"context_length must be a positive integer (tokens), got {context_length!r}")


class ThresholdStore:
    """Thresholds per (model id, context length). `get` returns, for a model, the entry whose context length is
    nearest in log scale (ties: the longer context, whose thresholds are the safer ones); None for an unknown model."""

    def __init__(self, entries: Mapping[tuple[str, int], Thresholds] | None = None) -> None:
        self._entries: dict[tuple[str, int], Thresholds] = {}
        for (model_id, context_length), th in (entries or {}).items():
            self.put(model_id, context_length, th)

    def put(self, model_id: str, context_length: int, thresholds: Thresholds) -> None:
        _check_key(model_id, context_length)
        if not isinstance(thresholds, Thresholds):
            raise ValueError(f"store Thresholds objects, got {type(thresholds).__name__}")
        self._entries[(model_id, context_length)] = thresholds

    def nearest(self, model_id: str, context_length: int) -> tuple[int, Thresholds] | None:
        """(stored context length, thresholds) of the nearest entry of `model_id`, or None."""
        _check_key(model_id, context_length)
        lengths = self.context_lengths(model_id)
        if not lengths:
            return None
        x = math.log(context_length)
        best = min(lengths, key=lambda c: (round(abs(math.log(c) - x), 9), -c))
        return best, self._entries[(model_id, best)]

    def get(self, model_id: str, context_length: int) -> Thresholds | None:
        found = self.nearest(model_id, context_length)
        return None if found is None else found[1]

    def models(self) -> list[str]:
        return sorted({m for m, _ in self._entries})

    def context_lengths(self, model_id: str) -> list[int]:
        return sorted(c for m, c in self._entries if m == model_id)

    def items(self) -> Iterator[tuple[tuple[str, int], Thresholds]]:
        return iter(sorted(self._entries.items()))

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ThresholdStore) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"ThresholdStore({dict(self.items())!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "store": [
            {"model_id": m, "context_length": c, "thresholds": th.to_dict()} for (m, c), th in self.items()]}

    @classmethod
    def from_dict(cls, d: Any) -> "ThresholdStore":
        found = _from_document(d, "the document")
        if not isinstance(found, ThresholdStore):
            raise ValueError("the document holds one Thresholds, not a store; read it with load_thresholds_file")
        return found

    def save(self, path: str | os.PathLike) -> None:
        _write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ThresholdStore":
        found = load_thresholds_file(path)
        if not isinstance(found, ThresholdStore):
            raise ValueError(f"{os.fspath(path)} holds one Thresholds, not a store (no model ids or context lengths); "
                             "read it with load_thresholds_file, or save a store with ThresholdStore.save")
        return found


def _write_json(path: str | os.PathLike, doc: dict) -> None:
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a file


def save_thresholds_file(path: str | os.PathLike, obj: Thresholds | ThresholdStore) -> None:
    """Write one `Thresholds` or a `ThresholdStore` as versioned JSON."""
    if isinstance(obj, ThresholdStore):
        _write_json(path, obj.to_dict())
    elif isinstance(obj, Thresholds):
        _write_json(path, {"format": FORMAT, "version": VERSION, "thresholds": obj.to_dict()})
    else:
        raise ValueError(f"save a Thresholds or a ThresholdStore, got {type(obj).__name__}")


def _from_document(doc: Any, where: str) -> Thresholds | ThresholdStore:
    hint = "write it with save_thresholds / ThresholdStore.save"
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise ValueError(f"{where} is not an hf-kvcache thresholds file (no \"format\": \"{FORMAT}\"); {hint}")
    version = doc.get("version")
    if not _is_int(version) or version < 1:
        raise ValueError(f"{where} has no valid \"version\" (got {version!r}); {hint}")
    if version > VERSION:
        raise ValueError(f"{where} is version {version}, newer than this hf-kvcache reads ({VERSION}); upgrade "
                         "hf-kvcache")
    kinds = [k for k in ("thresholds", "store") if k in doc]
    if len(kinds) != 1:
        raise ValueError(f"{where} must hold exactly one of \"thresholds\" (one entry) or \"store\" (a list of "
                         f"entries), found {kinds or 'neither'}")
    unknown = sorted(set(doc) - {"format", "version", kinds[0]})
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}")
    try:
        if kinds[0] == "thresholds":
            return Thresholds.from_dict(doc["thresholds"])
        entries = doc["store"]
        if not isinstance(entries, list):
            raise ValueError("\"store\" must be a list of {model_id, context_length, thresholds} objects")
        store = ThresholdStore()
        for i, e in enumerate(entries):
            if not isinstance(e, Mapping) or set(e) != {"model_id", "context_length", "thresholds"}:
                raise ValueError(f"store entry {i} must be an object with exactly model_id, context_length, "
                                 f"thresholds; got {e!r}")
            if (e["model_id"], e["context_length"]) in store._entries:
                raise ValueError(f"store entry {i} repeats model {e['model_id']!r} at context length "
                                 f"{e['context_length']!r}; keep one entry per pair")
            store.put(e["model_id"], e["context_length"], Thresholds.from_dict(e["thresholds"]))
        return store
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_thresholds_file(path: str | os.PathLike) -> Thresholds | ThresholdStore:
    """Read a file written by `save_thresholds_file` (one `Thresholds` or a `ThresholdStore`); a bad file raises
    ValueError saying what is wrong."""
    path = os.fspath(path)
    with open(path) as f:
        text = f.read()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); a thresholds "
                         "file is written by save_thresholds / ThresholdStore.save") from None
    return _from_document(doc, path)


def select_thresholds(found: Thresholds | ThresholdStore, model_id: str | None = None,
                      context_length: int | None = None, where: str = "the store") -> Thresholds:
    """One `Thresholds` out of what a file held: the file's own, or the store's nearest entry for `model_id` /
    `context_length` (each may be left out when the store leaves no choice)."""
    if isinstance(found, Thresholds):
        return found
    models = found.models()
    if model_id is None:
        if len(models) != 1:
            raise ValueError(f"{where} holds models {models}; pass model_id= to choose one")
        model_id = models[0]
    lengths = found.context_lengths(model_id)
    if not lengths:
        raise ValueError(f"{where} has no entry for model {model_id!r}; it holds {models}")
    if context_length is None:
        if len(lengths) != 1:
            raise ValueError(f"{where} holds {model_id!r} at context lengths {lengths}; pass context_length= to take "
                             "the nearest")
        context_length = lengths[0]
    return found.get(model_id, context_length)
