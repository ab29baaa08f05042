"""Building and loading the C sources of the CPU kernels: compiled once per machine with the system C compiler
(`$CC`, else `cc`) into `~/.cache/hf-kvcache/native/` (`$HF_KVCACHE_NATIVE_DIR` to move it), keyed by the source,
the flags and the CPU, and loaded with `ctypes`. Imports nothing of the package, so that `quant` can reach a kernel
without a cycle."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass
class LibraryBuild:
    """The outcome of building and loading a library: one of the two is set once it was tried."""

    lib: ctypes.CDLL | None = None
    error: str | None = None  # why there is no library
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tried(self) -> bool:
        return self.lib is not None or self.error is not None

    def load(self, make: Callable[[], ctypes.CDLL], what: str) -> ctypes.CDLL | None:
        """The library `make` builds, built once (the first caller builds, the others wait); None after one
        warning naming `what` (and what runs instead) where it cannot be built."""
        if not self.tried:
            with self.lock:
                if not self.tried:
                    try:
                        self.lib = make()
                    except (OSError, RuntimeError) as exc:
                        self.error = str(exc)
                        logger.warning("hf_kvcache: %s is unavailable (%s)", what, exc)
        return self.lib


def switched_off() -> bool:
    """Whether `HF_KVCACHE_NATIVE=0` turns the C kernels off (callers keep their torch code)."""
    return os.environ.get("HF_KVCACHE_NATIVE", "1") == "0"


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build_dir() -> Path:
    return Path(os.environ.get("HF_KVCACHE_NATIVE_DIR") or Path.home() / ".cache" / "hf-kvcache" / "native")


def _local_headers(source_path: Path, source: bytes) -> list[bytes]:
    """The bytes of each header `source` (the text of `source_path`) includes by a quoted name from its own folder
    (`#include "x.h"`), so that a change to one rebuilds every source that includes it."""
    names = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', source, flags=re.MULTILINE)
    return [(source_path.parent / n.decode()).read_bytes() for n in names]


def compile_library(source_path: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """`source_path` compiled with the system C compiler and `flags` into the build folder (once per source, flags
    and CPU; concurrent builders each write their own file, then one atomic rename), loaded.

    Raises:
        RuntimeError: no compiler, or the compile failed (its error in the message)."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    if shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler: {cc[0]!r} is not on PATH (set CC)")
    source = source_path.read_bytes()
    source += b"".join(_local_headers(source_path, source))
    key = hashlib.sha256(b"\0".join([source, " ".join(cc + list(flags)).encode(), _cpu_key().encode()])).hexdigest()
    target = _build_dir() / f"{source_path.stem}_{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            run = subprocess.run([*cc, *flags, str(source_path), "-o", tmp, "-lm"], capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"{' '.join(cc)} failed: {run.stderr.strip()[-2000:]}")
            os.replace(tmp, target)  # atomic: concurrent builders each write their own file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))
