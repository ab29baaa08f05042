"""The benchmark suites of `hf-kvcache compare --suite NAME`: one module each, one function each, one row schema.

Every suite module holds `run(opts) -> list[Row]` (rows of `hf_kvcache.eval.rows`: `suite`, `cache`, `model`,
`tokens` plus its metric columns) and `OPTIONS`, the dataclass of its options (`suites.options`: `SuiteOptions`, the
options every suite takes, plus its own; the command line is generated from them). `run_suite` picks the module by
name. Options left at None take the suite's own default (`tokens`, `caches`, `chunk`, `decode_steps`).
"""

from __future__ import annotations

from ..rows import Row
from .options import (MODE_HELP, MODES, SUITES, SuiteOptions, check_mode, options_class, suite_module,
                      suite_options)

__all__ = ["MODES", "MODE_HELP", "SUITES", "SuiteOptions", "check_mode", "log_row", "options_class", "run_suite",
           "suite_options"]


def log_row(row: Row, keys: tuple[str, ...] = ("perplexity", "ratio", "seconds")) -> None:
    """One progress line for a row as soon as it is measured (long suites take minutes per row)."""
    from ..rows import COLUMNS

    parts = [f"{COLUMNS.get(k, ('{:.1f}', k))[1]} {COLUMNS.get(k, ('{:.1f}', k))[0].format(row[k])}"
             for k in keys if row.get(k) is not None]
    print(f"  .. {row['cache']}: " + ", ".join(parts), flush=True)


def run_suite(opts: SuiteOptions) -> list[Row]:
    """Rows of the suite `opts.suite`."""
    module = suite_module(opts.suite)
    if not isinstance(opts, module.OPTIONS):
        raise ValueError(f"--suite {opts.suite} runs with {module.OPTIONS.__name__}, got {type(opts).__name__}: build "
                         "the options with suites.suite_options(suite, **values)")
    if opts.threads is not None:
        import torch

        torch.set_num_threads(opts.threads)
    return module.run(opts)
