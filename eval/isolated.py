"""Run a measurement in a fresh Python process, so that what one measurement allocated (or its peak resident
memory) does not show in the next: `in_fresh_process(func, **kwargs)` spawns an interpreter, calls `func(**kwargs)`
there and returns its result; `status_kib(field)` reads this process's memory counters there (Linux), and
`reset_peak_kib()` / `peak_since_kib(before)` measure what a run adds at its peak."""

from __future__ import annotations

import ctypes
import gc
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


def status_kib(field: str) -> int:
    """This process's `field` of `/proc/self/status` in KiB (e.g. "VmRSS", "VmHWM").

    Raises:
        ValueError: when the file has no such field (not Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {field}; this measurement needs Linux")


def reset_peak_kib() -> int:
    """Hands freed heap back to the system and resets this process's peak resident memory (VmHWM) to its current
    resident memory, so that a peak read afterwards counts only what is live now and what the run adds (Linux).

    Returns:
        The resident memory now, in KiB: the baseline `peak_since_kib` subtracts."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    return status_kib("VmRSS")


def peak_since_kib(before: int) -> int:
    """KiB the peak resident memory rose above `before` (`reset_peak_kib`'s baseline) since that reset; never
    negative (the peak counter is at least the resident memory it was reset to)."""
    return max(0, status_kib("VmHWM") - before)
