"""Where a rollout worker's policy versions come from: a pointer's sources tried in order
(rollout/sources.py: peers' relays, then the trainer), each fetch verified against the manifest this
worker can load, the result kept as the next delta's parent and offered to this worker's own relay.

`PolicyFetcher.fetch` runs on the worker's fetch thread; it fetches in the fetch child processes
(rollout/fetch_process.py) where there are some, else in this process. A relay that fails is counted
and passed over for the next source; one serving other bytes than the signed digest is distrusted
for that version (`VersionSwap.distrust`); the trainer's failure is raised."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc

from broker.policy_client import (
    FetchCancel,
    FetchCancelled,
    FetchedPolicy,
    PolicyClient,
    PolicyClientConfig,
    ReceiveBuffers,
    check_reachable,
)
from broker.policy_server import PolicyServerConfig
from broker.registry import PolicyPointer
from broker.relay import Relay
from broker.signing import Signer, policy_token
from broker.tls import ServerTLS
from policy import manifest as mf
from policy.chunks import ChecksumMismatch
from policy.manifest_check import check_manifest

from .config import RolloutConfig
from .fetch_process import FetchProcess, FetchRequest
from .metrics import WorkerStats
from .sources import fetch_sources
from .swap import VersionSwap, why

__all__ = ["PolicyFetcher"]


class PolicyFetcher:
    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        worker_id: str,
        fingerprint: str,
        expected,
        cuda: bool,
        swap: VersionSwap,
        stats: WorkerStats,
        signer: Signer | None,
        log: Callable[[str], None],
    ):
        self.cfg, self.worker_id, self.fingerprint, self.expected = cfg, worker_id, fingerprint, expected
        self.swap, self.stats, self.signer, self.log = swap, stats, signer, log
        self._held = None  # the last version fetched here (in this process), to fetch the next against
        self.relay: Relay | None = None  # `start_relay`
        self.relay_address = ""  # what peers dial (rollout.relay_advertise, else the bound address)
        self._lock = threading.Lock()  # the fetch thread counts, the metrics thread reads
        # Peers' relays are checked against the worker certificate's name (rollout.relay_server_name).
        self._relay_tls = cfg.tls
        if cfg.tls.enabled and cfg.relay_server_name:
            self._relay_tls = replace(cfg.tls, server_name=cfg.relay_server_name)
        if cfg.tls.enabled:  # missing TLS files: fail at start, not at every fetch
            PolicyClientConfig(address="tls-files-check:1", tls=cfg.tls)
        self.process, self.buffers = self._receivers(cuda)

    def _receivers(self, cuda: bool) -> tuple[FetchProcess | None, ReceiveBuffers | None]:
        """The fetch child process (rollout.fetch_process; CUDA's default) and where versions are received.
        On CUDA page-locked memory kept across versions (the engine copies out of it at the swap); on the
        CPU fresh memory per version (the model's packed tensors alias the fetched bytes, so the next fetch
        must not overwrite them). With a child, its shared slab, reused likewise."""
        in_child = cuda if self.cfg.fetch_process is None else self.cfg.fetch_process
        if in_child:
            process = FetchProcess(
                pinned=cuda,
                reuse=cuda,
                processes=self.cfg.fetch_processes,
                log=lambda line: self.log(f"{self.worker_id}: {line}"),
            )
            return process, process.buffers
        return None, ReceiveBuffers(pinned=True) if cuda else None

    def start_relay(self) -> None:
        """This worker's relay for its peers: the trainer's server code with its limits, the run token
        (only authenticated peers are served where there is one), and with rollout.tls the worker's
        own certificate, peers' client certificates signed by tls.ca required."""
        cfg = self.cfg
        if not cfg.relay_advertise and cfg.relay_host in ("0.0.0.0", "::", "[::]"):
            # (checked here, not in RolloutConfig: the trainer's pod loads the same config without it)
            raise ValueError(
                f"rollout.relay_host={cfg.relay_host!r} is no address to dial: set rollout.relay_advertise"
            )
        tls = cfg.tls
        token = policy_token(self.signer)
        self.relay = Relay(
            PolicyServerConfig(
                host=cfg.relay_host,
                port=cfg.relay_port,
                keep_versions=2,  # the newest and its parent: a peer holding the parent gets a delta
                tls=ServerTLS(cert=tls.cert, key=tls.key, client_ca=tls.ca) if tls.enabled else ServerTLS(),
                run_token=token,
                serve_unauthenticated=not token,
                deltas=True,
            )
        )
        port = self.relay.start()
        self.relay_address = cfg.relay_advertise or f"{cfg.relay_host}:{port}"
        self.log(f"{self.worker_id}: relay for peers on {cfg.relay_host}:{port} (advertised {self.relay_address})")

    def relay_sent_bytes(self) -> int:
        return self.relay.server.stats()["bytes_sent"] if self.relay is not None else 0

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
        if self.relay is not None:
            self.relay.stop()

    def fetch(self, pointer: PolicyPointer, cancel: FetchCancel) -> tuple[FetchedPolicy, float, str]:
        """The verified version (bytes in `buffers` on CUDA), fetched from the first of its sources that
        serves it: (the policy, perf_counter when it was complete, the source). A relay's failure is
        counted and the next source asked, the trainer's is raised. A version fetched whole is offered
        to this worker's relay."""
        sources = fetch_sources(
            pointer,
            self.worker_id,
            policy_address=self.cfg.policy_address,
            distrusted=self.swap.distrusted,
            own_address=self.relay_address,
        )
        held = self._held
        for source in sources[:-1]:
            if cancel.is_set():
                raise FetchCancelled(f"version {pointer.version}: fetch cancelled")
            try:
                fetched = self._from_relay(source, pointer, cancel, held)
            except FetchCancelled:
                raise
            except Exception as e:  # dead, slow, other bytes: the next source
                self._relay_failed(pointer, source, e)
                held = None if self.buffers is not None else held  # the attempt wrote over it
                continue
            return self._fetched(fetched, source, relayed=True)
        fetched = self._fetch_from(
            sources[-1], pointer, cancel, held, timeout_s=self.cfg.fetch_timeout_s, tls=self.cfg.tls
        )
        return self._fetched(fetched, sources[-1], relayed=False)

    def _from_relay(self, source: str, pointer: PolicyPointer, cancel: FetchCancel, held) -> FetchedPolicy:
        """`pointer`'s version from a relay within relay_timeout_s, waiting while the relay does not
        hold it yet (NOT_FOUND, or UNAVAILABLE before its first version: it is fetching it itself)."""
        deadline = time.monotonic() + self.cfg.relay_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return self._fetch_from(source, pointer, cancel, held, timeout_s=max(0.05, left), tls=self._relay_tls)
            except grpc.RpcError as e:
                code = e.code() if callable(getattr(e, "code", None)) else None
                if code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE) or left < 0.1:
                    raise
            if cancel.is_set():
                raise FetchCancelled(f"version {pointer.version}: fetch cancelled")
            time.sleep(0.05)

    def _fetch_from(self, address: str, pointer: PolicyPointer, cancel: FetchCancel, held, *, timeout_s: float, tls):
        request = FetchRequest(
            address=address,
            fingerprint=self.fingerprint,
            version=pointer.version,
            digest=pointer.content_digest,
            fetch_timeout_s=timeout_s,
            call_timeout_s=min(10.0, timeout_s),  # GetManifest: within a relay's deadline too
            streams=self.cfg.fetch_streams,
            tls=tls,
            run_token=policy_token(self.signer),
        )
        # A server gone from this address (a restarted trainer, a dead relay) fails here at once,
        # so the next source (or pointer) is tried within a loop, not after the fetch's deadline.
        check_reachable(address)
        if self.process is not None:
            return self.process.fetch(request, check=self._check_manifest, cancel=cancel)
        if self.buffers is not None:
            self._held = None  # the fetch writes over it
        with PolicyClient(request.client_config()) as client:
            return client.fetch(
                pointer.version,
                digest=pointer.content_digest,
                check=self._check_manifest,
                buffers=self.buffers,
                cancel=cancel,
                parent=held,
            )

    def _fetched(self, fetched: FetchedPolicy, source: str, *, relayed: bool) -> tuple[FetchedPolicy, float, str]:
        """A verified fetch: counted (installed or not: a version fetched and then passed over for a
        newer one is still the next one's delta parent), kept as the next delta's parent, offered to
        the relay."""
        at = time.perf_counter()
        self._count(fetched, relayed)
        if self.process is None:
            self._held = fetched.held()
        if self.relay is not None and fetched.held() is not None:  # whole tensors (tp_size 1)
            try:  # copied into the relay's own buffers: the next fetch reuses these
                if self.relay.offer(fetched.manifest, fetched.data):
                    with self._lock:
                        self.stats.relay_versions_offered += 1
            except Exception as e:  # the relay is a service to peers: never this worker's failure
                self.log(f"{self.worker_id}: relaying v{fetched.version} failed: {why(e)}")
        return fetched, at, source

    def _count(self, fetched: FetchedPolicy, relayed: bool) -> None:
        st = fetched.stats
        with self._lock:
            self.stats.policy_fetch_bytes += st.bytes
            self.stats.policy_delta_fetches += st.delta_parent > 0
            self.stats.policy_deltas_refused += st.delta_refused
            self.stats.policy_relay_fetches += relayed
        if st.delta_refused:
            self.log(f"{self.worker_id}: v{fetched.version}: {st.delta_refusal}; fetched it whole")

    def _relay_failed(self, pointer: PolicyPointer, source: str, e: Exception) -> None:
        """One line and a count per relay passed over; bytes failing the signed digest distrust it
        for this version (rollout/sources.py leaves it out of the retries)."""
        wrong = isinstance(e, (mf.DigestMismatch, ChecksumMismatch)) and bool(pointer.content_digest)
        if wrong:
            self.swap.distrust(pointer, source)
        with self._lock:
            self.stats.policy_relay_fallbacks += 1
            n = self.stats.policy_relay_fallbacks
        self.log(
            f"{self.worker_id}: relay {source} failed for v{pointer.version}: {why(e)}"
            f"{' (other bytes than signed: not asked for it again)' if wrong else ''}; next source (#{n} relay fallback)"
        )

    def _check_manifest(self, manifest) -> None:
        check_manifest(manifest, self.expected, max_total_bytes=self.cfg.max_policy_bytes)
