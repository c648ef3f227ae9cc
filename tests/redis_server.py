"""A real redis-server for tests, on a free loopback port, ended after use."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

START_TIMEOUT_S = 10.0


@contextmanager
def redis_server() -> Iterator[str]:
    """Yields its redis:// URL; skips the test where redis-server is not installed (.ci/run
    installs it)."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (Debian package redis-server; .ci/run installs it)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)
