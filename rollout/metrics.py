"""The rollout worker's Prometheus metrics (`tandem_rollout_*`; one worker per endpoint: Prometheus
adds the pod as `instance`). Names per the conventions (`_total` counters, `_seconds`, units in every
HELP):
- counters (table COUNTERS), gauges (table GAUGES) and the labelled families of LABELLED (prompts
  refused by why, the last swap by part), read at scrape time from the worker's `stats()` dict;
- histogram `tandem_rollout_policy_fetch_seconds`, observed at each swap (`observe_fetch`);
- the default process collector (broker/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import prometheus_client as prom
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from broker.metrics import MetricsEndpoint

# stats() key -> (name, HELP)
COUNTERS = {
    "groups": ("tandem_rollout_groups_total", "prompt groups generated and committed (groups)"),
    "generated_tokens": ("tandem_rollout_generated_tokens_total", "completion tokens generated (tokens)"),
    "policy_fetch_bytes": (
        "tandem_rollout_policy_fetch_bytes_total",
        "policy tensor bytes of every verified fetch over gRPC, installed or passed over for a newer version (bytes)",
    ),
    "policy_delta_fetches": (
        "tandem_rollout_policy_delta_fetches_total",
        "versions rebuilt from a delta against the version held before (broker/delta.py) (versions)",
    ),
    "policy_deltas_refused": (
        "tandem_rollout_policy_deltas_refused_total",
        "deltas refused (a wrong parent, a corrupt payload, a rebuilt tensor failing the manifest's "
        "checksums) and fetched whole instead (deltas)",
    ),
    "policy_fetch_failures": (
        "tandem_rollout_policy_fetch_failures_total",
        "policy fetches that failed and will be retried (fetches)",
    ),
    "versions_refused": (
        "tandem_rollout_versions_refused_total",
        "announced versions refused: a contract fingerprint not this worker's, a manifest it cannot load, "
        "values no quantizer produces, non-finite activations while generating (versions)",
    ),
    "tokens_on_stale_kv": (
        "tandem_rollout_tokens_on_stale_kv_total",
        "completion tokens sampled on KV an older version computed (loop.inflight_updates keeps the KV "
        "across a swap; 0 when draining on swap) (tokens)",
    ),
    "inflight_swaps": (
        "tandem_rollout_inflight_swaps_total",
        "versions installed with samples in flight, which continued under them (loop.inflight_updates) (versions)",
    ),
    "policy_sources_distrusted": (
        "tandem_rollout_policy_sources_distrusted_total",
        "sources that served other content than the signed pointer names (a manifest of another digest, "
        "or bytes not its manifest's): not asked for that version again (sources)",
    ),
    "policy_relay_fetches": (
        "tandem_rollout_policy_relay_fetches_total",
        "versions fetched from a peer's relay instead of the trainer (rollout.relay, trainer.relay_fanout) (versions)",
    ),
    "policy_relay_fallbacks": (
        "tandem_rollout_policy_relay_fallbacks_total",
        "relays passed over for the next source: dead, slower than rollout.relay_timeout_s, or serving bytes "
        "that failed verification (the log names each) (fetch attempts)",
    ),
    "relay_sent_bytes": (
        "tandem_rollout_relay_sent_bytes_total",
        "TensorChunk bytes this worker's relay served to peers (bytes)",
    ),
    "relay_versions_offered": (
        "tandem_rollout_relay_versions_offered_total",
        "versions this worker's relay took in to serve, each verified whole here (versions)",
    ),
}
GAUGES = {
    "policy_version": ("tandem_rollout_policy_version", "policy version in use (0 before the first)"),
    "generated_tokens_per_second": (
        "tandem_rollout_generated_tokens_per_second",
        "completion tokens per second of generation: the last committed group's tokens over the time "
        "since the previous commit or its own start, whichever is later (tokens/s)",
    ),
    "policy_staleness": (
        "tandem_rollout_policy_staleness",
        "newest announced version minus the version in use, at the last group start (versions)",
    ),
    "publish_to_live_seconds": (
        "tandem_rollout_publish_to_live_seconds",
        "from the trainer's pointer to the last version (published_at) until it was live here (seconds)",
    ),
}
# stats() key (a dict: label value -> number) -> (kind, name, label, HELP)
LABELLED = {
    "prompts_refused": (
        "counter",
        "tandem_rollout_prompts_refused_total",
        "why",
        "prompt entries dead-lettered by this worker, by why: unsigned (no valid run-secret signature), "
        "malformed (undecodable), invalid (rollout.prompt_check), failed (generating or scoring raised), "
        "redelivered (a poison pill: over rollout.max_prompt_deliveries) (entries)",
    ),
    "swap_part_seconds": (
        "gauge",
        "tandem_rollout_policy_swap_part_seconds",
        "part",
        "the last version's swap, by part: receive (gRPC streams), verify (digests after the last chunk), "
        "drain_wait (fetched, waiting for the groups in flight), h2d (copy into the engine or model), "
        "swap (the batcher and bookkeeping) (seconds)",
    ),
}
FETCH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class WorkerStats:
    """What the worker counts and last measured (its swap machine counts the rest: rollout/swap.py)."""

    groups: int = 0
    generated_tokens: int = 0
    policy_fetch_bytes: int = 0
    policy_delta_fetches: int = 0
    policy_deltas_refused: int = 0
    tokens_on_stale_kv: int = 0
    inflight_swaps: int = 0
    policy_relay_fetches: int = 0
    policy_relay_fallbacks: int = 0
    relay_versions_offered: int = 0
    generated_tokens_per_second: float = 0.0
    policy_staleness: int = 0
    publish_to_live_seconds: float = 0.0
    prompts_refused: dict[str, int] = field(default_factory=dict)  # why -> entries
    swap_part_seconds: dict[str, float] = field(default_factory=dict)  # part -> seconds (replaced per swap)


class WorkerMetrics:
    """The endpoint on `port` (-1 off, 0 a free one: `.port`); `stats` is called at every scrape, from
    the endpoint's thread, and returns every key of the tables above."""

    def __init__(self, port: int, host: str, stats: Callable[[], dict]):
        self.endpoint = MetricsEndpoint(port, host)
        self.port = self.endpoint.port
        self._fetch_seconds = prom.Histogram(
            "tandem_rollout_policy_fetch_seconds",
            "time to fetch, verify and load one policy version (seconds)",
            buckets=FETCH_BUCKETS,
            registry=self.endpoint.registry,
        )
        self.endpoint.registry.register(_Collector(stats))

    def observe_fetch(self, seconds: float) -> None:
        self._fetch_seconds.observe(seconds)

    def close(self) -> None:
        self.endpoint.close()


class _Collector:
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        for key, (name, help_text) in COUNTERS.items():
            # CounterMetricFamily adds `_total` to the exposed sample; the family name is without it.
            yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=s[key])
        for key, (name, help_text) in GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=s[key])
        for key, (kind, name, label, help_text) in LABELLED.items():
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_type(name.removesuffix("_total"), help_text, labels=[label])
            for label_value, value in s[key].items():
                family.add_metric([label_value], value)
            yield family
