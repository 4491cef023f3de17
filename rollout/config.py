"""The rollout worker's configuration: one frozen dataclass, validated.

Each field is documented by the string below it (shown by `tandem run --explain rollout.KEY`); the
sampling temperature is the run's (`loop.temperature`), shared with the trainer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from broker.health import HealthConfig
from broker.tls import ClientTLS
from policy.fields import is_int, is_number
from policy.tracing import TraceConfig

_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The `rollout:` section: one rollout worker."""

    heartbeat_s: float = 2.0
    """Seconds between a worker's heartbeats."""
    heartbeat_ttl_s: float = 10.0
    """A heartbeat expires after this long (> heartbeat_s)."""
    reclaim_idle_s: float = 20.0
    """Prompt entries idle this long in a dead worker are claimed by another."""
    max_prompt_deliveries: int = 3
    """A prompt entry handed out more often than this without being finished (each worker that held
    it died or lost it, e.g. it crashed them) is a poison pill: dead-lettered on reclaim, never handed
    to the next worker. 3 lets an innocent prompt outlive two SIGKILLs of its holders in a row; a
    worker's own refusals (rollout/prompt_check.py) dead-letter at the first delivery."""
    fetch_timeout_s: float = 60.0
    """Deadline of one policy fetch (seconds)."""
    fetch_streams: int = 1
    """Concurrent FetchTensors streams (one connection and thread each) per policy fetch, the
    version's tensors split between them by bytes (broker.policy_client). 1 is the fastest measured
    on the H200 host (1.04 GB/s; 2/4/8 streams 0.77/0.65/0.56 GB/s: the receive threads and the one
    sha256 thread contend for the GIL; docs/benchmarks.md, "Fetch streams and the in-place
    update"): measure again with bench/bench_swap.py when the client's hashing changes."""
    fetch_process: bool | None = None
    """Fetch and verify policies in a child process of the worker (rollout/fetch_process.py) into
    shared memory, so that receiving and hashing never slow decoding (they hold the GIL);
    null = on for cuda, off for cpu (the CPU engine's weights alias fresh memory per version)."""
    fetch_processes: int = 2
    """Child processes receiving one policy fetch (where `fetch_process` is on: CUDA's default), the
    version's tensors split between them by bytes, each writing its part into the one shared slab
    (rollout/fetch_process.py). Measured on the H200 host (4.38 GB, bench/bench_swap.py
    --processes; docs/benchmarks.md, "Fetch processes per worker"): 1 / 2 / 4 / 6 processes
    0.72 / 1.49 / 1.55 / 1.67 GB/s. From 2 on the trainer's PolicyServer limits (its one event loop
    at ~1 core; two workers fetching at once shared 1.77 GB/s), so 2: nearly all of the gain for the
    least CPU beside the decode loops."""
    read_block_ms: int = 500
    """How long one read of the prompts stream blocks."""
    tls: ClientTLS = field(default_factory=ClientTLS)
    """TLS to the trainer's policy gRPC (PEM paths): the CA that signed the trainer's certificate,
    plus a client cert and key where the trainer requires them (mTLS)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """grpc.health.v1 for Kubernetes probes: SERVING once a verified policy is loaded, NOT_SERVING
    before and while draining."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    """A profile of the generation loop once, `after_s` seconds in (off while `dir` is "")."""
    metrics_port: int = 0
    """Prometheus metrics of this worker: 0 = a free port, -1 = off, else that port (bound on metrics_host)."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus port binds: loopback by default; in a pod its IP (status.podIP,
    through TANDEM_ROLLOUT_METRICS_HOST)."""
    device: str = "cpu"
    """Where generation runs: "cpu" (rollout/engine.py on dequantized weights, the default) or
    "cuda" / "cuda:N" (rollout/packed_engine.py: packed 4-bit weights, CUDA graphs, on-device sampling)."""
    memory_fraction: float = 0.0
    """cuda only: the share of the GPU's memory this worker may allocate (torch's caching allocator,
    `torch.cuda.set_per_process_memory_fraction`), for processes sharing one GPU; 0 = no cap."""
    decode_priority: str = "normal"
    """cuda only: "high" runs generation on a stream of high CUDA priority (the block scheduler
    prefers its kernels over waiting ones of normal streams: this worker's weight copies, a process
    sharing the GPU through MPS); "normal" on the default stream."""
    max_batch: int = 64
    """KV slots: rows decoded at once (cuda: the engine's batch and its largest graph bucket); a
    group with more samples than this runs them as slots free up."""
    kv_capacity: int = 1024
    """cuda only: KV length of a slot (prompt + new tokens); a longer request is refused."""
    max_inflight_groups: int = 1
    """Prompt groups a worker holds and generates at once (continuous batching, rollout/batching.py):
    their samples share the KV slots (max_batch of them), a new sample is admitted into a slot as
    soon as another finishes, and a group is committed when all its samples are done. 1 = one group
    at a time (its samples still run in up to max_batch slots). A group holds its place until its
    longest sample ends, so slots freed by short samples are refilled only from groups already in
    flight: more than max_batch / n_samples keeps the slots full (docs/benchmarks.md,
    "Continuous batching")."""
    max_policy_bytes: int = 64 << 30
    """A manifest declaring more tensor bytes than this is refused (policy.manifest_check)."""
    ignore_stop: bool = False
    """BENCHMARK ONLY: completions run to task.max_new_tokens whatever they sample (the stop token
    does not end them), so a system measurement gets completions of a known length. Every trajectory
    says so (info "ignore_stop"), and so does every trainer metrics row of a step that used one
    (`benchmark_ignore_stop`). Never for training: rewards of such completions mean little."""
    policy_address: str = ""
    """host:port to dial for policies instead of the trainer address in policy:latest ("" = the
    pointer's): a local proxy or port-forward in front of the trainer. Versions, fingerprints and the
    pointer's signature are checked as always."""
    relay: bool = False
    """Serve the versions this worker fetched and verified to its peers (broker.relay: the trainer's
    server code, limits and run token; with rollout.tls the worker's own tls.cert/key, client
    certificates signed by tls.ca required), the newest two, so a peer can get a delta. The trainer
    names the relays in the signed pointer where trainer.relay_fanout > 0 (docs/running.md, "Relays")."""
    relay_host: str = "127.0.0.1"
    """Address the relay binds (a pod binds "0.0.0.0" and advertises its IP: relay_advertise)."""
    relay_port: int = 0
    """Port of the relay; 0 = a free port."""
    relay_advertise: str = ""
    """host:port peers dial for this worker's relay, sent with its heartbeat; "" = relay_host and the
    bound port. In a pod: the pod IP and the relay port (TANDEM_ROLLOUT_RELAY_ADVERTISE)."""
    relay_server_name: str = ""
    """With rollout.tls: the name checked against a relay's certificate (the worker certificate every
    worker presents) instead of the dialed host, a pod IP ("" = the dialed host)."""
    relay_timeout_s: float = 20.0
    """Deadline of a fetch from a relay (waiting for the relay to hold the version included), after
    which the next source is asked (the trainer last, under fetch_timeout_s)."""

    def __post_init__(self):
        errors = []
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s:
            errors.append(f"heartbeat_s={self.heartbeat_s}, heartbeat_ttl_s={self.heartbeat_ttl_s} (need 0 < s < ttl)")
        if self.reclaim_idle_s <= 0 or self.fetch_timeout_s <= 0 or self.read_block_ms <= 0:
            errors.append(
                f"reclaim_idle_s={self.reclaim_idle_s}, fetch_timeout_s={self.fetch_timeout_s}, "
                f"read_block_ms={self.read_block_ms} (must be > 0)"
            )
        if not -1 <= self.metrics_port <= 65535:
            errors.append(f"metrics_port={self.metrics_port} (-1 = off, 0 = free, else a port)")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            errors.append(f"device={self.device!r} (want 'cpu', 'cuda' or 'cuda:N')")
        if self.fetch_process is not None and not isinstance(self.fetch_process, bool):
            errors.append(f"fetch_process={self.fetch_process!r} (want true, false or null)")
        if not is_int(self.fetch_streams, 1, 16):
            errors.append(f"fetch_streams={self.fetch_streams!r} (need an int in [1, 16])")
        if not is_int(self.fetch_processes, 1, 16):
            errors.append(f"fetch_processes={self.fetch_processes!r} (need an int in [1, 16])")
        if not is_int(self.max_prompt_deliveries, 1, 1000):
            errors.append(f"max_prompt_deliveries={self.max_prompt_deliveries!r} (need an int in [1, 1000])")
        if not is_int(self.max_inflight_groups, lo=1):
            errors.append(f"max_inflight_groups={self.max_inflight_groups!r} (need an int >= 1)")
        if not 0 <= self.memory_fraction <= 1:
            errors.append(f"memory_fraction={self.memory_fraction} (want 0 < f <= 1, or 0 = no cap)")
        if self.max_batch < 1 or self.kv_capacity < 2:
            errors.append(f"max_batch={self.max_batch}, kv_capacity={self.kv_capacity} (need >= 1 and >= 2)")
        if self.decode_priority not in ("normal", "high"):
            errors.append(f"decode_priority={self.decode_priority!r} (want normal or high)")
        if not isinstance(self.ignore_stop, bool):
            errors.append(f"ignore_stop={self.ignore_stop!r} (want true or false)")
        if self.policy_address and not _is_host_port(self.policy_address):
            errors.append(f"policy_address={self.policy_address!r} (want host:port or '')")
        errors += self._relay_errors()
        if errors:
            raise ValueError("RolloutConfig: " + "; ".join(errors))

    def _relay_errors(self) -> list[str]:
        errors = []
        if not isinstance(self.relay, bool):
            errors.append(f"relay={self.relay!r} (want true or false)")
        if not is_int(self.relay_port, 0, 65535):
            errors.append(f"relay_port={self.relay_port!r} (want 0 = a free port, else a port)")
        if not isinstance(self.relay_host, str) or not self.relay_host or any(c.isspace() for c in self.relay_host):
            errors.append(f"relay_host={self.relay_host!r} (want an address to bind)")
        if self.relay_advertise and not _is_host_port(self.relay_advertise):
            errors.append(f"relay_advertise={self.relay_advertise!r} (want host:port or '')")
        if not is_number(self.relay_timeout_s, 0.01, 3600):
            errors.append(f"relay_timeout_s={self.relay_timeout_s!r} (want seconds in [0.01, 3600])")
        if not isinstance(self.relay_server_name, str) or any(c.isspace() for c in self.relay_server_name):
            errors.append(f"relay_server_name={self.relay_server_name!r} (want a name without whitespace, or '')")
        if self.relay and self.tls.enabled and not self.tls.cert:
            errors.append("relay=true with rollout.tls needs tls.cert and tls.key (the relay presents them to peers)")
        return errors


def _is_host_port(value: object) -> bool:
    if not isinstance(value, str) or len(value) > 256 or any(c.isspace() for c in value):
        return False
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
