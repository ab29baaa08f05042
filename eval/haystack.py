"""Haystacks of real prose in model tokens: a window of a book that starts at a sentence, and the sentence ends where
something may be inserted (the passkey / needle suites and the RULER-style tasks build their contexts with these).

    book = tokenizer(load_text("moby-dick"), add_special_tokens=False).input_ids
    filler = filler_window(tokenizer, book, 3000, random.Random(0))
    cut = nearest_split(sentence_splits(tokenizer, filler), 0.5 * len(filler))
"""

from __future__ import annotations

import random

SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"')
LEAD = 512  # tokens searched for the first sentence start of a window


def sentence_ends(tokenizer, ids: list[int]) -> list[int]:
    """Indices i such that a sentence ends with token i-1 (a split point before token i)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return [i + 1 for i, p in enumerate(pieces) if p.rstrip().endswith(SENTENCE_ENDS)]


def filler_window(tokenizer, book: list[int], length: int, rng: random.Random) -> list[int]:
    """`length` tokens of `book` from a random place (one `rng.randrange` call), starting at a sentence start.

    Args:
        tokenizer: the model's tokenizer (to find sentence ends).
        book: the token ids of the whole text.
        length: tokens wanted.
        rng: the random source.

    Returns:
        `length` consecutive token ids of `book`.
    """
    if len(book) < length + LEAD + 1:
        raise ValueError(f"the text has {len(book)} tokens; need more than {length + LEAD} for a {length}-token "
                         "haystack: pick a longer --text or fewer tokens")
    start = rng.randrange(0, len(book) - length - LEAD)
    window = book[start : start + length + LEAD]
    ends = sentence_ends(tokenizer, window[:LEAD])
    first = ends[0] if ends else 0
    return window[first : first + length]


def sentence_splits(tokenizer, filler: list[int]) -> list[int]:
    """Where an insertion keeps sentences whole: 0, every sentence end inside `filler`, and `len(filler)`."""
    return [0] + sentence_ends(tokenizer, filler[:-1]) + [len(filler)]


def nearest_split(splits: list[int], target: float) -> int:
    """The split point of `splits` closest to the token position `target`."""
    return min(splits, key=lambda i: abs(i - target))
