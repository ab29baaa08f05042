"""`compare --suite long`: streaming perplexity at several lengths, one stream per cache (`eval/long_context.py`).

Each cache streams `max(--tokens)` tokens of `--text` from `--start` in `--chunk`-token forwards (default 512) through
the loop `--loop` names (`attached`, as `generate` runs; `plain`, a user's own `model(ids, past_key_values=cache)`
loop; `unserved`, that loop with nothing reported to the cache: `bench.LOOPS`); the rows at shorter lengths are the
same stream's first tokens. Rows: the long-context rows (`perplexity`, `ratio`, `bytes`, `chunk_nll` per 64
positions, `loop`, `start`, `chunk`) with `delta_pct` against the `dynamic` row of the same tokens and its 95 % paired
block-bootstrap interval (`low_pct`, `high_pct`). With `--json` each row is written as soon as it is measured, and a
rerun with the same file measures only the rows it lacks and keeps every row the file held (each with the command
that measured it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench import parse_specs
from ..long_context import BASELINE, LongRun, compare_to_baseline, is_ours
from ..long_context import run as run_streams
from ..rows import Row
from .options import SuiteOptions, loop_option

DEFAULT_CACHES = [BASELINE, "tiered", "tiered_long"]
DEFAULT_LENGTHS = [8192]
NLL_BLOCK = 64  # positions per nll unit of the paired interval


@dataclass
class LongOptions(SuiteOptions):
    """`--suite long`: streaming perplexity at 8K-32K in one loop."""

    loop: str = loop_option()


OPTIONS = LongOptions


def run(opts: LongOptions) -> list[Row]:
    """The rows of this model's window, `dynamic` first (it runs first when listed), then every other row the
    `--json` file holds (other caches, loops, windows), so that writing the rows back loses none of them."""
    specs = parse_specs(opts.caches or DEFAULT_CACHES)
    if BASELINE not in [s.label for s in specs]:
        raise ValueError(f"--suite long compares against {BASELINE!r}: add it to --caches")
    window = LongRun(opts.model, opts.start, list(opts.tokens or DEFAULT_LENGTHS), opts.text, opts.chunk or 512,
                     NLL_BLOCK, [opts.loop])
    rows = run_streams(specs, window, opts.json)
    wanted = {(s.label, opts.loop if is_ours(s) else "plain") for s in specs}  # the loops `run_streams` ran them in
    def asked(r: Row) -> bool:
        return ((r["model"], r["start"], r["text"]) == (opts.model, opts.start, opts.text)
                and r["tokens"] in window.lengths and (r["cache"], r["loop"]) in wanted)

    mine = sorted(compare_to_baseline([r for r in rows if asked(r)]),
                  key=lambda r: (r["tokens"], r["cache"] != BASELINE))
    return mine + [r for r in rows if not asked(r)]  # the file's other rows as they were written


def table_rows(rows: list[Row]) -> list[Row]:
    """What `compare --from-json` prints for a file of this suite: the rows with their deltas."""
    return compare_to_baseline(rows)
