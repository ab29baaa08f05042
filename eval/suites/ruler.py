"""`--suite ruler`: RULER-style long-context tasks (`hf_kvcache.eval.ruler_tasks`) over every cache, scored against
the full cache on the same samples.

    hf-kvcache compare --suite ruler --model qwen2.5-coder-0.5b --tokens 4096 8192 --task-samples 8 \\
        --caches dynamic int8 int4 tiered kivi h2o --budgets 0.5 0.25 --mode agnostic --json rows.json

Each sample is a prompt of exactly `--tokens` model tokens (haystack of `--text`, Moby Dick by default; qa_speaker's
excerpts from Shakespeare), answered greedily by the model with each cache, in `--mode`:
* "agnostic": the context goes through the cache first (one forward, or `--chunk`-token forwards), so it is
  compressed before the question is seen; then the question and the answer (`passkey.answer`).
* "question": context + question prefilled together; quantizing caches then decode over what they stored, an h2o
  cache is evicted to its budget of the context + the question first (`passkey.question_aware_cache`).
The full cache (`dynamic`) always runs, first, as the baseline; its prefill (one forward: no `--chunk`) is recorded,
and every cache that only stores what it is given (the quantizing caches that calibrate nothing) is filled by
replaying it instead of a forward of its own (`eval/replay.py`; bit for bit what its own prefill stores), so such a
cache costs a question and a short answer. A resumed sample missing two caches or more records the full cache's
prefill again first. A sample's score is the fraction of its expected
strings found in the answer (`ruler_tasks.score`). The loop runs sample by sample (every task's sample 0, then 1, ...)
and every cache on each, so a run cut off at any point leaves paired results.

Rows: with `--json`, one row per (sample, cache) is written as soon as it is measured (`score`, `answer`, `expected`,
`depths`, `held`, `bytes`, `fp16_bytes`, `replayed`, `seconds`, `answer_nll`: the mean nll in nats a token of the right
answer `RulerSample.gold_text`, teacher-forced on a copy of the cache as the answer starts, `passkey.gold_nll`: a graded
score where the string match is all or nothing); `--resume` keeps those already in the file and runs the others (a
summary row whose samples came from the file names the invocations that measured them in `earlier_commands`; its
`command` is the resumed run's). The suite returns (and `compare` prints, then writes over the file) one summary row per
(tokens, mode, cache, task) and per "average" over the tasks: `accuracy` (mean score), `samples`, `delta_pts` (points vs
the full cache on the same samples) with `low_pts` / `high_pts` (its 95 % paired bootstrap interval,
`paired.paired_difference`; the average's resamples within each task), `ratio` (the full cache's fp16 bytes / this
cache's bytes when the answer starts), `held` and `results` (the sample rows); where every sample has it, `nll` (the
mean `answer_nll`, each task weighing the same) and `delta_nll` with `low_nll` / `high_nll` (its paired interval against
the full cache, positive: the right answer is less likely with this cache). `summary_rows` turns sample rows (a cut-off
file) into these rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import json
import math
import os
import time
from collections import defaultdict

from ..assets import load_model, load_plays, load_text
from ..bench import CacheSpec, parse_specs
from ..paired import paired_difference
from ..pareto import Point
from ..replay import PrefillReplay
from ..rows import Row, make_row, write_json
from ..ruler_tasks import ALL_TASKS, TASKS, RulerSample, TaskGenerator, score
from .options import SuiteOptions, budgets_option, check_mode, mode_option, option, seed_option
from .passkey import answer, with_budgets

BASELINE = "dynamic"
DEFAULT_TOKENS = 4096
DEFAULT_SAMPLES = 8  # per task and length
DEFAULT_CACHES = ["dynamic", "int8", "int4", "tiered", "kivi", "h2o"]
DEFAULT_BUDGETS = [0.5, 0.25]
AVERAGE = "average"
SAMPLE_KEYS = ("model", "tokens", "mode", "task", "sample", "cache", "seed")  # what makes a sample row unique


@dataclass
class RulerOptions(SuiteOptions):
    """`--suite ruler`: RULER-style tasks at each of `tokens` (several), scored against the full cache."""

    budgets: list[float] | None = budgets_option()
    mode: str = mode_option()
    seed: int = seed_option()
    tasks: list[str] | None = option(None, "task names (default: every task but the long-answer niah_recall)",
                                     type=str, nargs="+")
    task_samples: int | None = option(None, "samples per task and length (default 8)", type=int)
    resume: bool = option(False, "keep the sample rows already in --json and run only the missing ones")
    prefills: str | None = option(None, "a folder keeping each sample's recorded prefill (one file per sample, about "
                                  "200 MB at 8K tokens on a 0.5B model): a later run on the same samples replays "
                                  "them instead of running the full cache's prefill again", type=str)


OPTIONS = RulerOptions


def ruler_specs(opts: SuiteOptions, model) -> list[CacheSpec]:
    """The caches of a run: `--caches` (default `DEFAULT_CACHES`), each budget-taking one at each of `--budgets`
    (default `DEFAULT_BUDGETS` with the default caches), the full cache first."""
    specs = parse_specs(opts.caches or DEFAULT_CACHES)
    budgets = opts.budgets or (DEFAULT_BUDGETS if opts.caches is None else None)
    if budgets:
        specs = with_budgets(specs, budgets, model)
    rest = [s for s in specs if s.label != BASELINE]
    if any(s.name == BASELINE for s in rest):
        raise ValueError(f"label the full cache {BASELINE!r}: it is the baseline every cache is compared with")
    for spec in rest:  # a cache that cannot be built for this model fails here, before the first sample
        spec.build(model)
    return [CacheSpec(BASELINE, {}, BASELINE), *rest]


def run_sample(model, tokenizer, spec: CacheSpec, sample: RulerSample, mode: str, chunk: int,
               prefill: PrefillReplay | None = None) -> dict:
    """The answer of one cache to one sample, scored: the measured part of a sample row (`prefill`: the sample's
    shared prefill, see `passkey.answer`; `replayed` says whether this cache took it)."""
    t0 = time.perf_counter()
    gold = tokenizer(sample.gold_text, add_special_tokens=False).input_ids
    a = answer(model, tokenizer, spec, sample.context_ids, sample.question_ids, sample.new_tokens, chunk, mode,
               prefill, gold_ids=gold)
    return {"score": score(sample.expected, a.text), "answer_nll": a.gold_nll, "answer": a.text,
            "expected": sample.expected,
            "depths": [round(d, 4) for d in sample.depths], "held": a.held, "bytes": a.bytes,
            "fp16_bytes": a.fp16_bytes, "answer_bytes": a.answer_bytes, "answer_fp16_bytes": a.answer_fp16_bytes,
            "replayed": a.replayed, "seconds": time.perf_counter() - t0}


def sample_rows_of(rows: list[Row]) -> list[Row]:
    """The sample rows in rows written by this suite: sample rows as they are, summary rows by their `results`."""
    out = []
    for r in rows:
        if r.get("suite") != "ruler":
            continue
        out += r["results"] if "results" in r else [r] if "sample" in r else []
    return out


def _with_commands(rows: list[Row]) -> list[Row]:
    """`rows` of an earlier file, each summary row's `command` stamped on its sample rows that lack one, so that a
    resumed run's summaries can say which invocations measured the samples it carried over (`earlier_commands`)."""
    for r in rows:
        for sample in r.get("results", []) if r.get("command") else []:
            sample.setdefault("command", r["command"])
    return rows


class SampleLog:
    """The sample rows of a run, rewritten to `path` (atomically) after every one; `resume` starts from those the
    file holds."""

    def __init__(self, path: str | None, resume: bool) -> None:
        self.path, self.rows = path, []
        if resume:
            if not path or not os.path.exists(path):
                raise ValueError("--resume continues the sample rows of an earlier --json file: give that file")
            with open(path) as f:
                self.rows = sample_rows_of(_with_commands(json.load(f)))
        self.done = {tuple(r.get(k) for k in SAMPLE_KEYS) for r in self.rows}

    def has(self, **key) -> bool:
        return tuple(key.get(k) for k in SAMPLE_KEYS) in self.done

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.done.add(tuple(row.get(k) for k in SAMPLE_KEYS))
        write_json(self.path, self.rows)


def run(opts: RulerOptions) -> list[Row]:
    """`--suite ruler`: see the module docstring."""
    check_mode(opts.mode)
    tasks = list(opts.tasks or TASKS)
    unknown = sorted(set(tasks) - set(ALL_TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; --tasks takes some of: {' '.join(ALL_TASKS)}")
    count = opts.task_samples or DEFAULT_SAMPLES
    lengths = list(opts.tokens or [DEFAULT_TOKENS])
    log = SampleLog(opts.json, opts.resume)
    model, tokenizer = load_model(opts.model)
    specs = ruler_specs(opts, model)
    gen = TaskGenerator(tokenizer, load_text(opts.text), load_plays() if "qa_speaker" in tasks else None)
    prompts = {(n, t): gen.samples(t, n, count, opts.seed) for n in lengths for t in tasks}  # bad lengths fail here
    for n in lengths:
        for i in range(count):
            for task in tasks:
                sample = prompts[n, task][i]
                key = dict(model=opts.model, tokens=n, mode=opts.mode, task=task, sample=i, seed=opts.seed)
                missing = [spec for spec in specs if not log.has(**key, cache=spec.label)]
                if not missing:
                    continue
                # one prefill for the caches that only store what they are given (eval/replay.py)
                ids = sample.context_ids + (sample.question_ids if opts.mode == "question" else [])
                path = _prefill_path(opts, key)
                prefill = PrefillReplay.load(path, ids) if path and os.path.exists(path) else PrefillReplay(ids)
                if len(missing) >= 2 and specs[0] not in missing and not prefill.updates:  # resumed: record again
                    run_sample(model, tokenizer, specs[0], sample, opts.mode, opts.chunk or 0, prefill)
                for spec in missing:
                    result = run_sample(model, tokenizer, spec, sample, opts.mode, opts.chunk or 0, prefill)
                    log.add(make_row("ruler", spec.label, opts.model, n, mode=opts.mode, task=task, sample=i,
                                     seed=opts.seed, **result))
                    if opts.progress:
                        print(f"  .. {n} {task} #{i} {spec.label}: score {result['score']:.2f} "
                              f"({result['seconds']:.1f} s) {result['answer'][:60]!r}", flush=True)
                    if path and prefill.updates and not os.path.exists(path):
                        prefill.save(path)
    wanted = {(opts.model, n, opts.mode) for n in lengths}
    return summary_rows([r for r in log.rows if (r["model"], r["tokens"], r["mode"]) in wanted])


def _prefill_path(opts: RulerOptions, key: dict) -> str | None:
    """Where `--prefills` keeps the recorded prefill of the sample `key` (None without the option).

    Raises:
        ValueError: when the folder does not exist."""
    if opts.prefills is None:
        return None
    if not os.path.isdir(opts.prefills):
        raise ValueError(f"--prefills {opts.prefills!r} is not a folder; create it first (mkdir -p {opts.prefills})")
    name = "_".join(str(key[k]) for k in ("model", "tokens", "mode", "task", "seed", "sample"))
    return os.path.join(opts.prefills, "".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".pt")


def summary_rows(rows: list[Row]) -> list[Row]:
    """One row per (model, tokens, mode, cache, task) and per task average, from sample rows (see the module
    docstring); a cache is compared with the full cache on the samples both have."""
    samples = sample_rows_of(rows)
    runs: dict[tuple, list[Row]] = defaultdict(list)
    for r in samples:
        runs[r["model"], r["tokens"], r["mode"], r.get("seed")].append(r)
    out = []
    for (model, tokens, mode, _), group in runs.items():
        by_cache: dict[str, dict[tuple[str, int], Row]] = defaultdict(dict)
        for r in group:
            by_cache[r["cache"]][r["task"], r["sample"]] = r
        base = by_cache.get(BASELINE, {})
        for cache, results in by_cache.items():
            tasks = list(dict.fromkeys(t for t, _ in results))
            for task in [*tasks, AVERAGE]:
                keys = [k for k in results if task in (k[0], AVERAGE)]
                out.append(_summary(model, tokens, mode, cache, task, [results[k] for k in keys],
                                    [base.get(k) for k in keys], cache == BASELINE))
    return out


def _summary(model: str, tokens: int, mode: str, cache: str, task: str, mine: list[Row], base: list[Row | None],
             is_base: bool) -> Row:
    accuracy = _task_mean([r["score"] for r in mine], [r["task"] for r in mine])
    row = make_row("ruler", cache, model, tokens, section=f"mode={mode}", mode=mode, task=task, accuracy=accuracy,
                   samples=len(mine))
    paired = [(m, b) for m, b in zip(mine, base) if b is not None]
    if paired and not is_base:
        _paired_into(row, "pts", paired, "score", 100.0)
    if all(m.get("answer_nll") is not None for m in mine):  # rows written before it was measured lack it
        row["nll"] = _task_mean([m["answer_nll"] for m in mine], [m["task"] for m in mine])
        scored = [(m, b) for m, b in paired if b.get("answer_nll") is not None]
        if scored and not is_base:
            _paired_into(row, "nll", scored, "answer_nll")
    row["ratio"] = _ratio(mine, [b for _, b in paired], "")
    if all(m.get("answer_bytes") for m in mine):  # rows written before these were measured lack them
        row["answer_ratio"] = _ratio(mine, [b for _, b in paired if b.get("answer_bytes")], "answer_")
    row.update(held=sum(m["held"] for m in mine) / len(mine), seconds=sum(m["seconds"] for m in mine) / len(mine),
               results=mine)
    earlier = sorted({m["command"] for m in mine if m.get("command")})
    if earlier:  # samples carried over by --resume: the runs that measured them (the row's `command` is this run's)
        row["earlier_commands"] = earlier
    return row


def _paired_into(row: Row, name: str, pairs: list[tuple[Row, Row]], key: str, scale: float = 1.0) -> None:
    """Set `delta_<name>` (the mean of `key` over this cache's samples minus the full cache's, each task weighing
    the same, times `scale`) and, where there is a spread to resample, `low_<name>` / `high_<name>` (its paired 95 %
    interval, `paired.paired_difference`) in `row`."""
    diff = paired_difference([m[key] for m, _ in pairs], [b[key] for _, b in pairs], [m["task"] for m, _ in pairs])
    row[f"delta_{name}"] = scale * diff.difference
    if not math.isnan(diff.low):  # one sample: no interval
        row[f"low_{name}"], row[f"high_{name}"] = scale * diff.low, scale * diff.high


def _interval_text(row: Row, name: str, fmt: str) -> str:
    """`delta_<name>` of a summary row with its interval, for a table cell ("baseline" for the full cache)."""
    if f"delta_{name}" not in row:
        return "baseline"
    text = fmt.format(row[f"delta_{name}"])
    if f"low_{name}" in row:
        text += f" [{fmt.format(row[f'low_{name}'])}, {fmt.format(row[f'high_{name}'])}]"
    return text


def _task_mean(values: list[float], tasks: list[str]) -> float:
    """The mean of `values` with every task weighing the same."""
    groups = [[v for v, t in zip(values, tasks) if t == task] for task in dict.fromkeys(tasks)]
    return sum(sum(g) / len(g) for g in groups) / len(groups)


def _ratio(mine: list[Row], base: list[Row], prefix: str) -> float:
    """The full cache's mean fp16-equivalent bytes (this cache's own without full-cache rows) over this cache's mean
    bytes, `prefix` "" when the answer starts, "answer_" once it is decoded."""
    fp16 = [b[f"{prefix}fp16_bytes"] for b in base] or [m[f"{prefix}fp16_bytes"] for m in mine]
    return (sum(fp16) / len(fp16)) / (sum(m[f"{prefix}bytes"] for m in mine) / len(mine))


def pareto_points(rows: list[Row]) -> list[Point]:
    """The task averages of one (model, tokens, mode) run as Pareto points (`eval.pareto.Point`): the ratio vs fp16
    once the answer is decoded (`answer_ratio`; the ratio when the answer starts for rows that lack it), the points
    lost against the full cache on the same samples (the loss), the average accuracy in % (the value).

    Raises:
        ValueError: when `rows` hold several runs (models, lengths or modes), or none."""
    averages = [r for r in summary_rows(rows) if r["task"] == AVERAGE]
    runs = sorted({(r["model"], r["tokens"], r["mode"]) for r in averages})
    if len(runs) != 1:
        raise ValueError(f"a Pareto front is of one model, length and mode; the rows hold {runs or 'none'}: pass "
                         "the rows of one run")
    return [Point(r["cache"], r.get("answer_ratio", r["ratio"]), 0.0 - r.get("delta_pts", 0.0), 100 * r["accuracy"],
                  f"{r['model']}, {r['tokens']} tokens, {r['mode']}") for r in averages]


def table_rows(rows: list[Row]) -> list[Row]:
    """What `compare --from-json` prints for a file of this suite: the summary rows (cut-off files hold sample
    rows)."""
    return summary_rows(rows)


def markdown_tables(rows: list[Row]) -> str:
    """The summary as markdown, one table per (model, tokens, mode): a line per cache with its ratio, the accuracy of
    each task (points vs the full cache in brackets), the average with its paired 95 % interval, and the samples;
    where every sample was scored with it, the right answer's mean nll and its paired difference with the full
    cache's."""
    summary = summary_rows(rows)
    runs: dict[tuple, list[Row]] = defaultdict(list)
    for r in summary:
        runs[r["model"], r["tokens"], r["mode"]].append(r)
    parts = []
    for (model, tokens, mode), group in runs.items():
        tasks = list(dict.fromkeys(r["task"] for r in group if r["task"] != AVERAGE))
        with_nll = all("nll" in r for r in group if r["task"] == AVERAGE)  # rows measured with the answer's nll
        lines = [f"**{model}, {tokens} tokens, mode {mode}**", "",
                 "| cache | vs fp16 (question / answered) | " + " | ".join(tasks)
                 + " | average | vs full, 95 % interval | samples |"
                 + (" answer nll | nll vs full, 95 % interval |" if with_nll else ""),
                 "|---" * (len(tasks) + 5 + 2 * with_nll) + "|"]
        cell = {(r["cache"], r["task"]): r for r in group}
        for cache in dict.fromkeys(r["cache"] for r in group):
            avg = cell[cache, AVERAGE]
            tasks_cells = [_task_cell(cell.get((cache, t))) for t in tasks]
            interval = _interval_text(avg, "pts", "{:+.1f}")
            ratio = f"{avg['ratio']:.2f}x" + (f" / {avg['answer_ratio']:.2f}x" if "answer_ratio" in avg else "")
            line = (f"| {cache} | {ratio} | " + " | ".join(tasks_cells)
                    + f" | {100 * avg['accuracy']:.1f} | {interval} | {avg['samples']} |")
            if with_nll:
                line += f" {avg['nll']:.3f} | {_interval_text(avg, 'nll', '{:+.3f}')} |"
            lines.append(line)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _task_cell(row: Row | None) -> str:
    if row is None:
        return "-"
    text = f"{100 * row['accuracy']:.0f}"
    return text + (f" ({row['delta_pts']:+.0f})" if "delta_pts" in row else "")
