"""Shared test fixtures.

- `redis_url` (session): a real `redis-server` on a free loopback port in a temp dir, no
  persistence; killed at the end. Missing redis-server fails the test (never skips).
- `run_id` (function): a run id unique to the test, so tests share the server safely.
- `free_port` (function): a callable returning a TCP port free on 127.0.0.1 right now.
- `async def` tests run on uvloop (asyncio where uvloop is missing) with a 60 s cap,
  without needing pytest-asyncio; fixtures stay synchronous, so create clients inside
  the test (a client belongs to the event loop it was created on).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import shutil
import uuid
from collections.abc import Callable, Iterator

import pytest

from broker.local_redis import LocalRedis, LocalRedisConfig
from broker.local_redis import free_port as _free_port
from broker.streams import run_async

ASYNC_TEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not on PATH; the integration tests need a real Redis 7.0+ "
            "(Debian: apt-get install redis-server, or `make redis`).",
            pytrace=False,
        )
    server = LocalRedis(LocalRedisConfig(workdir=tmp_path_factory.mktemp("redis")))
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", request.node.name)[:40]
    return f"{stem}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    if pyfuncitem.get_closest_marker("asyncio") or pyfuncitem.get_closest_marker("anyio"):
        return None  # leave it to that plugin
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    run_async(asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S))
    return True
