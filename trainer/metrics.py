"""Per-step metrics: one JSON object per line in metrics.jsonl, the same numbers as Prometheus gauges."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsSink:
    def __init__(self, path: Path, *, port: int = -1):
        """port: -1 = no Prometheus endpoint, 0 = a free port (see `.port`), else that port."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self.port = None
        self._gauges = {}
        self._server = None
        if port >= 0:
            import prometheus_client as prom

            self._registry = prom.CollectorRegistry()
            self._prom = prom
            self._server, _ = prom.start_http_server(
                port, addr="127.0.0.1" if port == 0 else "0.0.0.0", registry=self._registry
            )
            self.port = self._server.server_port

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._server is None:
            return
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                g = self._gauges.get(key)
                if g is None:
                    g = self._gauges[key] = self._prom.Gauge(f"tandem_trainer_{key}", key, registry=self._registry)
                g.set(value)

    def close(self) -> None:
        self._file.close()
        if self._server is not None:
            self._server.shutdown()
