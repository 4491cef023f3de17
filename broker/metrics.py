"""A Prometheus endpoint for one service (trainer or rollout worker), with the default process
metrics (CPU seconds, resident memory, open fds, start time) and Python platform info.

Names follow the Prometheus conventions: counters end in `_total`, times are `_seconds`, sizes
`_bytes`; every metric's HELP says what it counts and in which unit. Counters whose totals must
survive a restart (the trainer's, restored from its checkpoint) come from a callback read at
scrape time (`add_callback`), not from `prometheus_client.Counter`, which always starts at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# (kind "counter" | "gauge", name, help, value)
Sample = tuple[str, str, str, float]


class _Callback:
    def __init__(self, fn: Callable[[], Iterable[Sample]]):
        self.fn = fn

    def collect(self):
        for kind, name, help_text, value in self.fn():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            # CounterMetricFamily adds `_total` to the exposed sample; the family name is without it.
            yield family(name.removesuffix("_total"), help_text, value=value)


class MetricsEndpoint:
    """port: -1 = off (`registry` still works, nothing listens), 0 = a free port (see `.port`),
    else that port; on `host` (loopback by default, the pod IP in Kubernetes)."""

    def __init__(self, port: int = -1, host: str = "127.0.0.1"):
        self.registry = prom.CollectorRegistry()
        prom.ProcessCollector(registry=self.registry)
        prom.PlatformCollector(registry=self.registry)
        self.port: int | None = None
        self._server = None
        if port >= 0:
            self._server, self._thread = prom.start_http_server(port, addr=host, registry=self.registry)
            self.port = self._server.server_port

    def add_callback(self, fn: Callable[[], Iterable[Sample]]) -> None:
        self.registry.register(_Callback(fn))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
