"""Passkey retrieval on real text: a random 5-digit key hidden at several depths of Moby Dick, then asked for.

Each trial: an instruction, a window of Moby Dick (a random place in the book, starting and split at sentence ends)
with the sentence "The pass key is 12345. Remember it. 12345 is the pass key." inserted at `depth` (0 = right after the
instruction, 1 = right before the question), then the question "Question: What is the pass key?\nAnswer: The pass key is".

Two modes (`mode`):
* "agnostic" (default; the protocol of kvpress and most KV-compression papers): the context (instruction + filler +
  key) goes through the cache first -- one forward, or `chunk`-token forwards -- so the cache compresses it with its
  own budget rule without seeing the question; then the question is fed and `new_tokens` tokens are decoded greedily
  (an `h2o` cache with a ratio budget keeps evicting to that ratio of the tokens seen as the question and answer come).
* "question" (question-aware): context + question are prefilled together (`chunk`-token forwards or one). A cache
  without a budget (`dynamic`, the quantizing caches) is built as the spec says and only differs from "agnostic" in
  that the question comes in the same prefill as the context. An `h2o` cache is built with `budget=1.0`, so nothing is
  evicted until the question has been seen; then `H2OCache.evict_to` drops every layer to the context budget + the
  question tokens, the question kept whatever its score, scored by the policy with the queries it holds -- those of
  the question (tova: the last question token; snapkv: the question tokens, `window` = their count unless the spec
  sets one; h2o: the mass of every query so far; knorm: none) -- and the answer is decoded over that cache, which
  evicts nothing more (the decoded tokens are all kept, as in kvpress). Budget: a ratio `f` keeps ceil(f x context
  tokens) context tokens, an int budget that many context tokens; the question comes on top. The first answer token
  comes from the logits of the prefill forward (every layer attended over the whole context; for SmolLM2 it is the
  space before the key's digits), the others from the compressed cache.
A trial is correct when the first number in the answer is the key. Every cache runs on the same trials (same seed),
with the same model; each result records `held`, the slots per KV head of layer 0 when the answer starts, and
`bytes`, what the cache holds then (`memory_stats`).

    hf-kvcache compare --suite passkey --caches dynamic h2o --budgets 0.2 0.5 --tokens 1024 --trials 20
    hf-kvcache passkey --caches dynamic 'h2o:{"budget":0.2}' --context 1024 --trials 20   (the same, older options)

Rows, one per cache (and budget): `tokens` (the context), `depth D` (accuracy at each depth), `accuracy` (mean over
every trial), `trials`, `seconds`, and `results` (every trial: depth, key, answer, correct).
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib
import copy
import dataclasses
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hf_kvcache.transformers_compat import cache_kwargs

from ..assets import load_model, load_text
from ..bench import CacheSpec, parse_specs
from ..haystack import filler_window, nearest_split, sentence_splits
from ..replay import PrefillReplay
from ..rows import Row, make_row
from .options import (SuiteOptions, budgets_option, check_mode, depths_option, mode_option, new_tokens_option,
                      seed_option, trials_option)

INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nQuestion: What is the pass key?\nAnswer: The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class PasskeyTrial:
    depth: float
    key: str
    context_ids: list[int]  # instruction + filler with the key inside
    question_ids: list[int]


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
            filler = filler_window(tokenizer, book, filler_len, rng)
            cut = nearest_split(sentence_splits(tokenizer, filler), depth * len(filler))
            context = instruction + filler[:cut] + needle + filler[cut:]
            out.append(PasskeyTrial(depth, key, context, question))
    return out


def first_number(answer: str) -> str | None:
    m = re.search(r"\d+", answer)
    return m.group(0) if m else None


@dataclass
class Answer:
    """What a cache answered to one prompt: the decoded `text`, and when the answer starts `held` (slots per KV head
    of layer 0), `bytes` (every tensor the cache holds, `memory_stats`) and `fp16_bytes` (its fp16 equivalent);
    `answer_bytes` / `answer_fp16_bytes`: the same once the answer is decoded (a cache that compresses a forward's
    tokens at its next update holds them uncompressed until then)."""

    text: str
    held: int
    bytes: int
    fp16_bytes: int
    answer_bytes: int = 0
    answer_fp16_bytes: int = 0
    replayed: bool = False  # the context came in by `PrefillReplay.replay`, not by a forward of this cache
    gold_nll: float | None = None  # mean nll (nats a token) of the given right answer on the compressed context


def _held(cache) -> tuple[int, int, int]:
    """(slots per KV head held by layer 0, bytes every tensor of the cache holds, their fp16 equivalent)."""
    from hf_kvcache.caches.base import memory_stats

    held = cache.tokens_held(0) if hasattr(cache, "tokens_held") else cache.get_seq_length()
    stats = memory_stats(cache)
    return int(held), int(stats["bytes"]), int(stats["fp16_bytes"])


def gold_nll(model, cache, lead_ids: list[int], gold_ids: list[int], first_logits: torch.Tensor | None = None
             ) -> float:
    """The mean negative log-likelihood (nats a token) of `gold_ids`, teacher-forced on a copy of `cache` the way the
    answer is decoded (the cache itself is left as it was, for the greedy answer that follows): `lead_ids` in one
    forward, then one forward a gold token, so that a cache that compresses what it holds at its next update (the
    calibrating `tiered` default) scores the answer on the same stored state as its greedy answer reads.

    Args:
        cache: the cache as the answer starts (context in, compressed as the mode says).
        lead_ids: what comes between the cache's content and the answer (the question in mode "agnostic"; empty in
            mode "question", where the question is in the cache and `first_logits` predicts the first token).
        gold_ids: the tokens of the right answer (at least one).
        first_logits: `[vocab]` the logits after the cache's last token, when `lead_ids` is empty.

    Returns:
        -mean log p(gold token | everything before it)."""
    from hf_kvcache.registry import attached

    if not gold_ids or (not lead_ids and first_logits is None):
        raise ValueError("score at least one gold token, after lead_ids or from first_logits")
    steps = ([lead_ids] if lead_ids else []) + [[t] for t in gold_ids[:-1]]  # each step's last logits: a gold token
    logits = [] if lead_ids else [first_logits.float()]
    if steps:
        scored = copy.deepcopy(cache)
        if hasattr(scored, "unbind"):  # the copy is bound by `attached` below, as the cache was
            scored.unbind()
        with attached(model, scored):
            for ids in steps:
                out = model(input_ids=torch.tensor([ids], device=model.device), **cache_kwargs(scored),
                            use_cache=True, logits_to_keep=1).logits
                logits.append(out[0, -1].float())
    gold = torch.tensor(gold_ids, device=model.device)
    return float(torch.nn.functional.cross_entropy(torch.stack(logits), gold))


def question_aware_cache(model, spec: CacheSpec, context_tokens: int, question_tokens: int):
    """(cache, tokens to keep per KV head after the prefill) for the question-aware mode: an `h2o` spec is built with
    `budget=1.0` (nothing evicted while context + question are prefilled) and, for snapkv without a `window`, the
    window set to the question's tokens; the tokens to keep are the spec's context budget (a ratio of
    `context_tokens`, or an int) + `question_tokens`. A cache without a budget (`dynamic`, the quantizing caches):
    (the cache of the spec, None) -- it only sees the question in the same prefill as the context."""
    if spec.name == "dynamic" or (spec.name != "h2o" and not takes_budget(spec, model)):
        return spec.build(model), None
    if spec.name != "h2o":
        raise ValueError(
            f"the question-aware mode drives the eviction of an h2o cache (H2OCache.evict_to); got the evicting cache "
            f"{spec.name!r}: use mode='agnostic' for it, or an h2o spec such as 'h2o:{{\"budget\":0.2}}'"
        )
    from hf_kvcache.caches.h2o import H2OOptions
    from hf_kvcache.registry import build_cache

    options = dict(spec.options)
    keep = H2OOptions(**options).budget_for(context_tokens) + question_tokens
    options["budget"] = 1.0
    options.pop("min_budget", None)  # applies to a ratio budget below 1; the context budget above used it
    if options.get("policy") == "snapkv" and options.get("window") is None:
        options["window"] = question_tokens
    return build_cache("h2o", model.config, **options), keep


@torch.inference_mode()
def answer(
    model, tokenizer, spec: CacheSpec, context_ids: list[int], question_ids: list[int], new_tokens: int = 8,
    chunk: int = 0, mode: str = "agnostic", prefill: PrefillReplay | None = None, gold_ids: list[int] | None = None,
) -> Answer:
    """Greedy answer of the model with the cache of `spec` to `context_ids + question_ids` (see the module docstring
    for `mode`; `chunk`: tokens per prefill forward, 0 = one forward), at most `new_tokens` tokens. A cache scored by
    context reconstruction (`policy="reconstruct"`) is scored once the context is in (`held_for_scoring`).

    `prefill`: a `PrefillReplay` shared by the caches of one prompt, of the ids one prefill forward takes (the
    context in mode "agnostic", context + question in mode "question"; a chunked prefill shares nothing). The full
    cache (`dynamic`) records its prefill into it; a cache that only stores what it is given is then filled by
    replaying it (`Answer.replayed`) instead of a forward of its own (`eval/replay.py`). `gold_ids`: the tokens of
    the right answer, whose teacher-forced nll on the cache as the answer starts is `Answer.gold_nll` (`gold_nll`)."""
    from hf_kvcache.caches.evict.reconstruct import held_for_scoring, reconstruction_prompt_ids
    from hf_kvcache.registry import attached

    check_mode(mode)
    if spec.lookahead and mode != "question":
        raise ValueError(f"{spec.label}: lookahead drafts the answer after the question is prefilled, which only the "
                         "question-aware mode does: use mode='question', or drop lookahead")
    if mode == "question":
        return _answer_question_aware(model, tokenizer, spec, context_ids, question_ids, new_tokens, chunk, prefill,
                                      gold_ids)
    cache = spec.build(model)
    dev = model.device
    context = torch.tensor([context_ids], device=dev)
    step = chunk if chunk and chunk > 0 else context.shape[1]
    full = torch.tensor([context_ids + question_ids], device=dev)
    cache, record, replayed = _take_prefill(prefill, context_ids, step, cache, lambda: spec.build(model))
    with attached(model, cache):  # the attention the cache needs, for the context as for the generate after it
        # a cache scored by reconstruction evicts once the whole context is in and scored
        with held_for_scoring(model, cache, context, reconstruction_prompt_ids(tokenizer)):
            if not replayed:
                with prefill.recording(cache) if record else contextlib.nullcontext():  # type: ignore[union-attr]
                    for s in range(0, context.shape[1], step):
                        model(input_ids=context[:, s : s + step], **cache_kwargs(cache), use_cache=True,
                              logits_to_keep=1)
        held = _held(cache)  # after the context: the question has not been seen
        nll = None if not gold_ids else gold_nll(model, cache, question_ids, gold_ids)
        out = model.generate(
            full, attention_mask=torch.ones_like(full), **cache_kwargs(cache), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        )
    return Answer(tokenizer.decode(out[0, full.shape[1] :], skip_special_tokens=True), *held, *_held(cache)[1:],
                  replayed=replayed, gold_nll=nll)


def _take_prefill(prefill: PrefillReplay | None, ids: list[int], step: int, cache, rebuild,
                  needs_logits: bool = False) -> tuple[Any, bool, bool]:
    """(the cache to run, whether its prefill of `ids` is to be recorded into `prefill`, whether it was filled by
    replaying `prefill`): a prefill shared by the caches of one prompt is used when it is of these ids and one
    forward of `step` tokens takes them (and, `needs_logits`, kept its last logits); the full cache records it, the
    others replay it or, when their prefill asks the attention for something, run a fresh cache (`rebuild()`)."""
    from transformers import DynamicCache

    if prefill is None or step < len(ids) or prefill.prompt_ids != list(ids):
        return cache, False, False
    if needs_logits and prefill.updates and prefill.logits is None:
        return cache, False, False
    if not prefill.updates:
        return cache, type(cache) is DynamicCache, False
    if prefill.replay(cache):
        return cache, False, True
    return rebuild(), False, False


def _answer_question_aware(model, tokenizer, spec: CacheSpec, context_ids: list[int], question_ids: list[int],
                           new_tokens: int, chunk: int, prefill: PrefillReplay | None = None,
                           gold_ids: list[int] | None = None) -> Answer:
    from hf_kvcache.caches.evict.lookahead import evict_with_lookahead
    from hf_kvcache.caches.evict.reconstruct import reconstruction_prompt_ids, score_context, scored_layers
    from hf_kvcache.registry import attached

    n, q = len(context_ids), len(question_ids)
    cache, keep = question_aware_cache(model, spec, n, q)
    full = torch.tensor([context_ids + question_ids], device=model.device)
    step = chunk if chunk and chunk > 0 else full.shape[1]
    record, replayed = False, False
    if keep is None:  # an evicting cache is driven by the attention of its own prefill
        cache, record, replayed = _take_prefill(prefill, context_ids + question_ids, step, cache,
                                                lambda: spec.build(model), needs_logits=True)
    tokens: list[int] = []
    with attached(model, cache):
        if replayed:
            logits = prefill.logits[None, None]  # type: ignore[union-attr,index]
        else:
            with prefill.recording(cache) if record else contextlib.nullcontext():  # type: ignore[union-attr]
                for s in range(0, full.shape[1], step):
                    logits = model(input_ids=full[:, s : s + step], **cache_kwargs(cache), use_cache=True,
                                   logits_to_keep=1).logits
            if record:
                prefill.logits = logits[0, -1]  # type: ignore[union-attr]
        if keep is not None:
            if scored_layers(cache):  # scored by reconstruction: the context is repeated, the question is not
                score_context(model, cache, full[:, :n], reconstruction_prompt_ids(tokenizer))
            if spec.lookahead:  # scored with the question's queries and those of the model's draft answer
                evict_with_lookahead(model, cache, logits[:, -1], keep, q, spec.lookahead)
            else:
                cache.evict_to(keep, protect_last=q)  # the question has been seen: down to the budget, question kept
        held = _held(cache)
        nll = None if not gold_ids else gold_nll(model, cache, [], gold_ids, first_logits=logits[0, -1])
        nxt = int(logits[0, -1].argmax())
        for _ in range(new_tokens):
            tokens.append(nxt)
            if nxt == tokenizer.eos_token_id or len(tokens) == new_tokens:
                break
            logits = model(input_ids=torch.tensor([[nxt]], device=full.device), **cache_kwargs(cache),
                           use_cache=True).logits
            nxt = int(logits[0, -1].argmax())
    return Answer(tokenizer.decode(tokens, skip_special_tokens=True), *held, *_held(cache)[1:], replayed=replayed,
                  gold_nll=nll)


def run_trial(
    model, tokenizer, spec: CacheSpec, trial: PasskeyTrial, new_tokens: int = 8, chunk: int = 0,
    mode: str = "agnostic",
) -> dict:
    """One trial: `{"depth", "key", "answer", "correct", "held", "bytes"}` (see the module docstring for `mode`)."""
    a = answer(model, tokenizer, spec, trial.context_ids, trial.question_ids, new_tokens, chunk, mode)
    return {"depth": trial.depth, "key": trial.key, "answer": a.text, "correct": first_number(a.text) == trial.key,
            "held": a.held, "bytes": a.bytes}


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
    mode: str = "agnostic",
) -> list[Row]:
    """One row per spec: accuracy per depth, mean accuracy, seconds, and the per-trial answers (`loaded`: the
    (model, tokenizer) of `model_name` when the caller has loaded them already; `mode`: see the module docstring,
    the row's `mode` says which)."""
    check_mode(mode)
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
        results = [run_trial(model, tokenizer, spec, t, new_tokens, chunk, mode) for t in items]
        rows.append(summarize(spec.label, model_name, context_tokens, results, depths, time.perf_counter() - t0,
                              mode))
    return rows


def summarize(label: str, model_name: str, context_tokens: int, results: list[dict], depths: tuple[float, ...],
              seconds: float, mode: str = "agnostic") -> Row:
    """The row of one cache: accuracy per depth and overall, with every trial's answer."""
    acc = {}
    for d in depths:
        hits = [r["correct"] for r in results if r["depth"] == d]
        acc[f"depth {d:g}"] = sum(hits) / len(hits) if hits else float("nan")
    return make_row("passkey", label, model_name, context_tokens, mode=mode, **acc,
                    accuracy=sum(r["correct"] for r in results) / len(results), trials=len(results), seconds=seconds,
                    results=results)


def takes_budget(spec: CacheSpec, model) -> bool:
    """Whether the cache of `spec` has a `budget` option (the evicting caches)."""
    options = getattr(spec.build(model), "options", None)
    return dataclasses.is_dataclass(options) and any(f.name == "budget" for f in dataclasses.fields(options))


def with_budgets(specs: list[CacheSpec], budgets: list[float], model) -> list[CacheSpec]:
    """Each spec that takes a budget once per budget (labelled `label budget=B`), the others once (a spec that sets
    its own budget too: it keeps it)."""
    out: list[CacheSpec] = []
    takers = 0
    for spec in specs:
        if not takes_budget(spec, model) or "budget" in spec.options:
            out.append(spec)
            continue
        takers += 1
        for b in budgets:
            value = int(b) if b > 1 and float(b).is_integer() else b  # 256 tokens, or 0.2 of the tokens seen
            out.append(dataclasses.replace(spec, options={**spec.options, "budget": value},
                                           label=f"{spec.label} budget={b:g}"))
    if not takers:
        raise ValueError("--budgets applies to caches with a budget option (h2o) that do not set their own; none of "
                         "--caches is one: add one, e.g. --caches dynamic h2o")
    for spec in out:  # a bad budget fails here, before the first trial
        spec.build(model)
    return out


@dataclass
class PasskeyOptions(SuiteOptions):
    """`--suite passkey`: a key hidden in filler text at each depth, asked for after the context."""

    budgets: list[float] | None = budgets_option()
    depths: list[float] = depths_option()
    trials: int = trials_option()
    seed: int = seed_option()
    new_tokens: int | None = new_tokens_option()
    mode: str = mode_option()

    def answer_tokens(self) -> int:
        """`new_tokens`, or the passkey default (8)."""
        return 8 if self.new_tokens is None else self.new_tokens


OPTIONS = PasskeyOptions


def run(opts: PasskeyOptions) -> list[Row]:
    """`--suite passkey`: the rows of `run_passkey`, each budget-taking cache at each of --budgets."""
    specs = parse_specs(opts.caches or ["dynamic", 'h2o:{"budget":0.2}'])
    context = opts.one_length(1024)
    loaded = load_model(opts.model)
    if opts.budgets:
        specs = with_budgets(specs, opts.budgets, loaded[0])
    return run_passkey(specs, opts.model, opts.text, context, tuple(opts.depths), opts.trials, opts.seed,
                       opts.answer_tokens(), opts.chunk or 0, progress=opts.progress, loaded=loaded, mode=opts.mode)


def dump_trials(path: str, trials: list[PasskeyTrial]) -> None:
    """The trials as JSON (token ids), so another environment (e.g. kvpress's) can run exactly the same ones."""
    with open(path, "w") as f:
        json.dump([asdict(t) for t in trials], f)
