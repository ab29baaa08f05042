"""A radix tree (compressed trie) over token ids: which stored prefixes share how many tokens with a query.

Edges carry runs of token ids; a node may hold an entry key (a stored prefix ending exactly there). `longest_match`
walks the query down the tree as far as it agrees (also part-way along an edge) and returns that depth and the
stored entry under the point reached that is shortest (cheapest to decode): every entry below that point starts
with the matched tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence


@dataclass
class _Node:
    edge: tuple[int, ...] = ()
    children: dict[int, "_Node"] = field(default_factory=dict)
    entry: str | None = None
    parent: "_Node | None" = None


class RadixTree:
    """Token-id prefixes -> entry keys, with longest-common-prefix lookup."""

    def __init__(self) -> None:
        self.root = _Node()
        self._where: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def tokens_of(self, key: str) -> tuple[int, ...]:
        return self._where[key]

    def insert(self, tokens: Sequence[int], key: str) -> str | None:
        """Store `key` at the prefix `tokens`; returns the key it replaced there (or None)."""
        tokens = tuple(int(t) for t in tokens)
        if not tokens:
            raise ValueError("cannot store an empty prefix")
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                new = _Node(tokens[i:], parent=node)
                node.children[tokens[i]] = new
                node, i = new, len(tokens)
                break
            common = _common(child.edge, tokens[i:])
            if common < len(child.edge):  # split the edge
                mid = _Node(child.edge[:common], parent=node)
                node.children[tokens[i]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + common
        old = node.entry
        if old is not None:
            self._where.pop(old, None)
        node.entry = key
        self._where[key] = tokens
        return old

    def remove(self, key: str) -> None:
        tokens = self._where.pop(key)
        node = self._find(tokens)
        node.entry = None
        # prune childless empty nodes, then merge a single child into its parent edge
        while node is not self.root and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node is not self.root and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[child.edge[0]] = child

    def _find(self, tokens: tuple[int, ...]) -> _Node:
        node, i = self.root, 0
        while i < len(tokens):
            node = node.children[tokens[i]]
            i += len(node.edge)
        return node

    def longest_match(self, query: Sequence[int]) -> tuple[int, list[tuple[str, int]]]:
        """(tokens of `query` shared with the deepest stored path, entries under that point as (key, length),
        shortest first). Entries are only those that contain the whole shared part."""
        query = tuple(int(t) for t in query)
        node, depth = self.root, 0
        while depth < len(query):
            child = node.children.get(query[depth])
            if child is None:
                break
            common = _common(child.edge, query[depth:])
            depth += common
            node = child
            if common < len(child.edge):
                break
        if depth == 0:
            return 0, []
        found = sorted(((k, len(self._where[k])) for k in self._entries_under(node)), key=lambda kv: kv[1])
        return depth, found

    def _entries_under(self, node: _Node) -> Iterator[str]:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.entry is not None:
                yield n.entry
            stack.extend(n.children.values())


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
