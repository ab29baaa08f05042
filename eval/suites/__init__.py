"""The benchmark suites of `hf-kvcache compare --suite NAME`: one module each, one function each, one row schema.

Every suite is a function `run(opts: SuiteOptions) -> list[Row]` (rows of `hf_kvcache.eval.rows`: `suite`, `cache`,
`model`, `tokens` plus its metric columns); `run_suite` picks it by name. Options a suite does not use are ignored;
options left at None take the suite's own default (`tokens`, `caches`, `chunk`, `decode_steps`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from ..rows import Row

# suite name -> module of this package that holds its `run`; peers and ablations are cache presets of perplexity
SUITES: dict[str, str] = {
    "perplexity": "perplexity",
    "peers": "perplexity",
    "ablations": "perplexity",
    "cpac": "cpac",
    "decode": "decode",
    "kernels": "kernels",
    "append": "append",
    "passkey": "passkey",
    "shared-prefix": "shared_prefix",
    "needle": "needle",
    "ruler": "ruler",
    "long": "long",
    "long-perplexity": "long",  # the suite name long-context rows carry (`eval/long_context.py`)
}


# passkey / needle / ruler: how the cache meets the question (see `suites.passkey`)
MODES = ("agnostic", "question")
MODE_HELP = ("agnostic: the context compressed before the question is seen; question: context + question prefilled "
             "together, then (h2o) evicted to the budget of the context + the question, then decoded")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (query-agnostic or question-aware), got {mode!r}")


@dataclass
class SuiteOptions:
    """The parsed options of `hf-kvcache compare` (None: the suite's default)."""

    suite: str = "perplexity"
    model: str = "smollm2-135m"
    text: str = "moby-dick"
    start: int = 5000
    tokens: list[int] | None = None  # tokens scored / cached; several for kernels, append, needle and ruler
    chunk: int | None = None  # tokens per forward (passkey: 0 prefills the context in one forward)
    caches: list[str] | None = None  # cache specs (name, name:{json}, label=name:{json}); added to a preset
    budgets: list[float] | None = None  # passkey / needle / ruler: each budget-taker at each budget; cpac: memory
    decode_steps: int | None = None  # single-token steps timed
    threads: int | None = None
    device: str | None = None
    progress: bool = True
    sections: list[str] | None = None  # cpac
    only: list[str] | None = None  # cpac curve labels (fnmatch patterns)
    timing_layer: int = 15  # cpac timing
    attn: str = "hf_kvcache"  # cpac: attention implementation
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # passkey
    trials: int = 20  # passkey, per depth
    seed: int = 0  # passkey, shared-prefix
    samples: int = 8  # shared-prefix: num_return_sequences
    heatmaps: str | None = None  # needle: folder for one heatmap PNG per cache
    new_tokens: int = 8  # passkey answer tokens
    mode: str = "agnostic"  # passkey: "agnostic" (context compressed before the question) or "question"
    batch: list[int] | None = None  # kernels
    kv_heads: int = 8  # kernels
    group: int = 4  # kernels: query heads per KV head
    head_dim: int = 128  # kernels
    bits: int = 2  # kernels
    iters: int = 10  # kernels: timed runs (median)
    tasks: list[str] | None = None  # ruler: task names (default: all)
    task_samples: int | None = None  # ruler: samples per task and length
    resume: bool = False  # ruler: keep the sample rows already in `json`, run the others
    json: str | None = None  # the rows file (ruler writes its sample rows there as they come)
    loop: str = "attached"  # perplexity suites: one of `bench.LOOPS` ("attached" as generate runs, "plain", "unserved")

    def one_length(self, default: int) -> int:
        """The single `tokens` value of a suite that takes one (its default when none is given)."""
        if not self.tokens:
            return default
        if len(self.tokens) != 1:
            raise ValueError(f"--suite {self.suite} takes one --tokens value, got {self.tokens}; only kernels, append, "
                             "needle and ruler take several")
        if self.tokens[0] < 2:
            raise ValueError(f"--tokens must be at least 2, got {self.tokens[0]}")
        return self.tokens[0]


def log_row(row: Row, keys: tuple[str, ...] = ("perplexity", "ratio", "seconds")) -> None:
    """One progress line for a row as soon as it is measured (long suites take minutes per row)."""
    from ..rows import COLUMNS

    parts = [f"{COLUMNS.get(k, ('{:.1f}', k))[1]} {COLUMNS.get(k, ('{:.1f}', k))[0].format(row[k])}"
             for k in keys if row.get(k) is not None]
    print(f"  .. {row['cache']}: " + ", ".join(parts), flush=True)


def run_suite(opts: SuiteOptions) -> list[Row]:
    """Rows of the suite `opts.suite`."""
    if opts.suite not in SUITES:
        raise ValueError(f"unknown suite {opts.suite!r}; pick one of: {', '.join(SUITES)}")
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
    module = importlib.import_module(f"{__name__}.{SUITES[opts.suite]}")
    return module.run(opts)
