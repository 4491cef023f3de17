"""Riding out Redis outages: one retry policy for every Redis client of a service.

`OutageRetry` is the redis-py retry policy that `broker.streams.connect()` installs on each client,
so that every command, pipeline, transaction and Lua script call retries, on `ConnectionError` /
`TimeoutError` (a server still loading its AOF answers LOADING, a `ConnectionError` too), with
bounded exponential backoff and full jitter:

    sleep_k = uniform(0, min(cap_s, base_s * 2**k))        k = 0, 1, 2, ... failures so far

until the outage has lasted `outage_s` seconds (measured from its first failure); then the last
error is raised as `RedisOutage`, a `ConnectionError` whose message says how long Redis was gone,
and the service exits non-zero (an orchestrator restarts it). One line is logged when an outage
starts and one when Redis answers again, however many commands were waiting.

Retried writes are at-least-once (a reply lost with the connection can repeat the command): the
streams tolerate that (idempotency keys for samples, duplicate prompts give duplicate samples).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")
_depth: contextvars.ContextVar[int] = contextvars.ContextVar("outage_retry_depth", default=0)  # nested calls


class RedisOutage(RedisConnectionError):
    """Redis stayed unreachable longer than the configured bound."""


def outage_in(error: BaseException | None, *, context: bool = False) -> RedisOutage | None:
    """The RedisOutage `error` is or wraps: through `__cause__` (redis-py re-raises connect() errors
    as ConnectionError; trainer.publisher's PublishError), with `context` also through `__context__`
    (an error raised while an outage unwound a `finally`) and exception groups."""
    for _ in range(16):
        if error is None or isinstance(error, RedisOutage):
            return error
        if context and isinstance(error, BaseExceptionGroup):
            return next(filter(None, (outage_in(e, context=True) for e in error.exceptions)), None)
        error = error.__cause__ or (error.__context__ if context else None)
    return None


class OutageRetry(Retry):
    """Retry every failed command until the current outage exceeds `outage_s` seconds.

    One instance is shared by all connections of a client (redis-py deep-copies the retry policy
    into each connection: `__deepcopy__` returns the instance itself), so an outage is one event
    with one start time however many commands hit it.
    """

    def __init__(
        self,
        *,
        outage_s: float = 60.0,
        base_s: float = 0.05,
        cap_s: float = 2.0,
        log: Callable[[str], None] = print,
        name: str = "redis",
    ):
        if not 0 <= outage_s <= 3600:
            raise ValueError(f"outage_s={outage_s}: want 0..3600 seconds")
        if not 0 < base_s <= cap_s:
            raise ValueError(f"base_s={base_s}, cap_s={cap_s}: want 0 < base_s <= cap_s")
        # retries=2**31: the bound is in seconds (below), not in attempts.
        super().__init__(NoBackoff(), 2**31, (RedisConnectionError, RedisTimeoutError, OSError))
        self.outage_s, self.base_s, self.cap_s, self.log, self.name = outage_s, base_s, cap_s, log, name
        self.down_since: float | None = None  # monotonic time of the current outage's first failure
        self.outages = 0  # outages seen (ridden out or not)

    def __deepcopy__(self, memo: dict) -> OutageRetry:
        return self

    def backoff_s(self, failures: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**(failures-1))]."""
        return random.uniform(0.0, min(self.cap_s, self.base_s * 2 ** min(failures - 1, 30)))

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        token = _depth.set(_depth.get() + 1)
        try:
            return await self._call(do, fail, is_retryable, with_failure_count)
        finally:
            _depth.reset(token)

    async def _call(self, do, fail, is_retryable, with_failure_count):
        failures = 0
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                inner = outage_in(error)
                if inner is not None:  # an inner retry gave up (redis-py retries connect() too)
                    raise inner from None
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                now = time.monotonic()
                if self.down_since is None:
                    self.down_since = now
                    self.outages += 1
                    self.log(
                        f"{self.name} unreachable ({type(error).__name__}: {str(error)[:160]}); "
                        f"retrying for up to {self.outage_s:g}s"
                    )
                await (fail(error, failures) if with_failure_count else fail(error))
                down = now - self.down_since
                if down >= self.outage_s:
                    raise RedisOutage(
                        f"{self.name} unreachable for {down:.1f}s (redis_outage_s={self.outage_s:g}): "
                        f"{type(error).__name__}: {error}"
                    ) from error
                await asyncio.sleep(min(self.backoff_s(failures), max(0.0, self.outage_s - down)))
                continue
            # Only the outermost call's success ends an outage: redis-py retries connect() through this
            # policy too, inside a command's retry, and a server that accepts connections but fails
            # every command (a TLS client certificate refused) must still hit the bound.
            if self.down_since is not None and _depth.get() == 1:
                self.log(f"{self.name} back after {time.monotonic() - self.down_since:.1f}s")
                self.down_since = None
            return result


async def run_script(redis: Any, script: str, *, keys: list, args: list) -> Any:
    """EVAL `script` (its text every time, not EVALSHA): a restarted or failed-over Redis has an empty
    script cache, and redis-py's NOSCRIPT reload can race a second restart; the scripts are small."""
    return await redis.eval(script, len(keys), *keys, *args)
