"""Run a measurement in a fresh Python process, so that what one measurement allocated (or its peak resident
memory) does not show in the next: `in_fresh_process(func, **kwargs)` spawns an interpreter, calls `func(**kwargs)`
there and returns its result."""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable


def in_fresh_process(func: Callable[..., Any], **kwargs: Any) -> Any:
    """`func(**kwargs)` in a spawned process (the environment, `OMP_NUM_THREADS` included, is inherited).

    Args:
        func: a module-level function (spawn pickles it by name); its arguments and result must pickle.
        kwargs: its keyword arguments.

    Returns:
        What `func` returned; an exception it raised is raised here."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(func, kwds=kwargs)
