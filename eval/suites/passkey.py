"""Passkey retrieval on real text: a random 5-digit key hidden at several depths of Moby Dick, then asked for.

Each trial: an instruction, a window of Moby Dick (a random place in the book, starting and split at sentence ends)
with the sentence "The pass key is 12345. Remember it. 12345 is the pass key." inserted at `depth` (0 = right after the
instruction, 1 = right before the question), then the question "Question: What is the pass key?\nAnswer: The pass key is".

Protocol (the one of kvpress and most KV-compression papers): the context (instruction + filler + key) goes through the
cache first -- one forward, or `chunk`-token forwards -- so the cache compresses it without seeing the question; then
the question is fed and `new_tokens` tokens are decoded greedily. A trial is correct when the first number in the
answer is the key. Every cache runs on the same trials (same seed), with the same model.

    hf-kvcache compare --suite passkey --caches dynamic h2o --budgets 0.2 0.5 --tokens 1024 --trials 20
    hf-kvcache passkey --caches dynamic 'h2o:{"budget":0.2}' --context 1024 --trials 20   (the same, older options)

Rows, one per cache (and budget): `tokens` (the context), `depth D` (accuracy at each depth), `accuracy` (mean over
every trial), `trials`, `seconds`, and `results` (every trial: depth, key, answer, correct).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import time
from dataclasses import asdict, dataclass

import torch

from ..assets import load_model, load_text
from ..bench import CacheSpec, parse_specs
from ..rows import Row, make_row
from . import SuiteOptions

INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nQuestion: What is the pass key?\nAnswer: The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"')


@dataclass
class PasskeyTrial:
    depth: float
    key: str
    context_ids: list[int]  # instruction + filler with the key inside
    question_ids: list[int]


def _sentence_ends(tokenizer, ids: list[int]) -> list[int]:
    """Indices i such that a sentence ends with token i-1 (a split point before token i)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    return [i + 1 for i, p in enumerate(pieces) if p.rstrip().endswith(SENTENCE_ENDS)]


def make_trials(
    tokenizer,
    text: str,
    context_tokens: int = 1024,
    depths: tuple[float, ...] = DEPTHS,
    trials: int = 20,
    seed: int = 0,
) -> list[PasskeyTrial]:
    """`trials` trials per depth, each with its own random key and its own window of `text`."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depths are fractions of the context in [0, 1], got {d}")
    rng = random.Random(seed)
    book = tokenizer(text, add_special_tokens=False).input_ids
    instruction = tokenizer(INSTRUCTION, add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    needle_len = len(tokenizer(NEEDLE.format(key="12345"), add_special_tokens=False).input_ids)
    filler_len = context_tokens - len(instruction) - needle_len
    if filler_len < 16:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for filler text")
    if len(book) < filler_len + 512:
        raise ValueError(f"the text has {len(book)} tokens; need more than {filler_len + 512}")
    out = []
    for depth in depths:
        for _ in range(trials):
            key = str(rng.randint(10000, 99999))
            needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
            start = rng.randrange(0, len(book) - filler_len - 512)
            window = book[start : start + filler_len + 512]
            ends = _sentence_ends(tokenizer, window[:512])
            first = ends[0] if ends else 0  # start at a sentence
            filler = window[first : first + filler_len]
            splits = [0] + _sentence_ends(tokenizer, filler[:-1]) + [len(filler)]
            target = depth * len(filler)
            cut = min(splits, key=lambda i: abs(i - target))
            context = instruction + filler[:cut] + needle + filler[cut:]
            out.append(PasskeyTrial(depth, key, context, question))
    return out


def first_number(answer: str) -> str | None:
    m = re.search(r"\d+", answer)
    return m.group(0) if m else None


@torch.inference_mode()
def run_trial(model, tokenizer, spec: CacheSpec, trial: PasskeyTrial, new_tokens: int = 8, chunk: int = 0) -> dict:
    from hf_kvcache.registry import attached

    cache = spec.build(model)
    dev = model.device
    context = torch.tensor([trial.context_ids], device=dev)
    step = chunk if chunk and chunk > 0 else context.shape[1]
    full = torch.tensor([trial.context_ids + trial.question_ids], device=dev)
    with attached(model, cache):  # the attention the cache needs, for the context as for the generate after it
        for s in range(0, context.shape[1], step):
            model(input_ids=context[:, s : s + step], past_key_values=cache, use_cache=True)
        out = model.generate(
            full, attention_mask=torch.ones_like(full), past_key_values=cache, max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )
    answer = tokenizer.decode(out[0, full.shape[1] :], skip_special_tokens=True)
    return {"depth": trial.depth, "key": trial.key, "answer": answer, "correct": first_number(answer) == trial.key}


def run_passkey(
    specs: list[CacheSpec],
    model_name: str = "smollm2-135m",
    text: str = "moby-dick",
    context_tokens: int = 1024,
    depths: tuple[float, ...] = DEPTHS,
    trials: int = 20,
    seed: int = 0,
    new_tokens: int = 8,
    chunk: int = 0,
    progress: bool = True,
    loaded: tuple | None = None,
) -> list[Row]:
    """One row per spec: accuracy per depth, mean accuracy, seconds, and the per-trial answers (`loaded`: the
    (model, tokenizer) of `model_name` when the caller has loaded them already)."""
    torch.manual_seed(0)
    model, tokenizer = loaded or load_model(model_name)
    all_trials = make_trials(tokenizer, load_text(text), context_tokens, depths, trials, seed)
    rows = []
    for spec in specs:
        items = all_trials
        if progress:
            from tqdm.auto import tqdm

            items = tqdm(all_trials, desc=f"passkey {spec.label}", unit="trial", leave=False)
        t0 = time.perf_counter()
        results = [run_trial(model, tokenizer, spec, t, new_tokens, chunk) for t in items]
        rows.append(summarize(spec.label, model_name, context_tokens, results, depths, time.perf_counter() - t0))
    return rows


def summarize(label: str, model_name: str, context_tokens: int, results: list[dict], depths: tuple[float, ...],
              seconds: float) -> Row:
    """The row of one cache: accuracy per depth and overall, with every trial's answer."""
    acc = {}
    for d in depths:
        hits = [r["correct"] for r in results if r["depth"] == d]
        acc[f"depth {d:g}"] = sum(hits) / len(hits) if hits else float("nan")
    return make_row("passkey", label, model_name, context_tokens, **acc,
                    accuracy=sum(r["correct"] for r in results) / len(results), trials=len(results), seconds=seconds,
                    results=results)


def takes_budget(spec: CacheSpec, model) -> bool:
    """Whether the cache of `spec` has a `budget` option (the evicting caches)."""
    options = getattr(spec.build(model), "options", None)
    return dataclasses.is_dataclass(options) and any(f.name == "budget" for f in dataclasses.fields(options))


def with_budgets(specs: list[CacheSpec], budgets: list[float], model) -> list[CacheSpec]:
    """Each spec that takes a budget once per budget (labelled `label budget=B`), the others once."""
    out: list[CacheSpec] = []
    for spec in specs:
        if not takes_budget(spec, model):
            out.append(spec)
            continue
        for b in budgets:
            value = int(b) if b > 1 and float(b).is_integer() else b  # 256 tokens, or 0.2 of the tokens seen
            out.append(CacheSpec(spec.name, {**spec.options, "budget": value}, f"{spec.label} budget={b:g}"))
    if len(out) == len(specs):
        raise ValueError("--budgets applies to caches with a budget option (h2o); none of --caches takes one: add "
                         "one, e.g. --caches dynamic h2o")
    for spec in out:  # a bad budget fails here, before the first trial
        spec.build(model)
    return out


def run(opts: SuiteOptions) -> list[Row]:
    """`--suite passkey`: the rows of `run_passkey`, each budget-taking cache at each of --budgets."""
    specs = parse_specs(opts.caches or ["dynamic", 'h2o:{"budget":0.2}'])
    context = opts.one_length(1024)
    loaded = load_model(opts.model)
    if opts.budgets:
        specs = with_budgets(specs, opts.budgets, loaded[0])
    return run_passkey(specs, opts.model, opts.text, context, tuple(opts.depths), opts.trials, opts.seed,
                       opts.new_tokens, opts.chunk or 0, progress=opts.progress, loaded=loaded)


def dump_trials(path: str, trials: list[PasskeyTrial]) -> None:
    """The trials as JSON (token ids), so another environment (e.g. kvpress's) can run exactly the same ones."""
    with open(path, "w") as f:
        json.dump([asdict(t) for t in trials], f)
