"""The rollout worker: prompt groups in, scored trajectory groups out, always with a verified policy.

Loop (up to `rollout.max_inflight_groups` groups in flight, continuous batching):
    newest policy announced? -> fetch it in the background (a thread: the broker client over
                                `rollout.fetch_streams` streams, checksums + fingerprint verified,
                                into host memory kept across versions; on CUDA the client runs in
                                a child process, rollout/fetch_process.py, so its receive and hash
                                Python never holds this process's GIL) and stop starting groups,
                                while the started ones keep decoding (drain); once both are done,
                                swap it in (copied into the live engine) and resume. A newer
                                pointer arriving meanwhile cancels that fetch and starts its own.
    room for a group? -> read prompt groups (own pending entries first, then entries reclaimed from
    dead workers, then new ones; unsigned, undecodable and poison-pill entries are dead-lettered by
    the queue) -> dead-letter one this worker cannot run (rollout/prompt_check.py) -> refuse to
    start one with a policy more than `max_staleness`
    versions behind the newest -> submit it to the batcher (rollout/batching.py,
    rollout/scheduler.py): its prompt is prefilled once, its n samples take KV slots as they free
    up and decode together with every other group's samples, from the packed quantized weights
    with per-token activation quantization at the recipe's sites
    a group's last sample done -> score with the task's verifier -> XADD the n trajectories and
    XACK the prompt in one transaction.
Every token of a group comes from the version that started it (tagged on its trajectories): versions
swap only when no started group is in flight, so no sequence, KV row or prefix spans two versions.
What is trusted is the signed pointer's content digest, not the server: a manifest with another digest
is refused before anything is allocated and its source is not asked for that version again (a new
pointer names another source or version); verified bytes holding values no quantizer produces, and a
live version whose activations or logits turn non-finite, are refused (`refused_versions`, never
loaded again; the groups in flight start again under the next version). Nothing a peer serves ends
the worker.
Prometheus on `rollout.metrics_port` (`WorkerMetrics`): generated tokens, groups, tokens/s,
policy fetch seconds and bytes, the split of the last swap (receive, verify, drain wait, h2d, swap), the
live version, refused versions, the staleness of the policy in use, refused prompts by why.

A group whose generation or scoring raises is dead-lettered with the error's line (groups that were
in a failed batch together are retried one at a time first); the worker goes on.
SIGTERM sets a flag: no group is read any more, the groups in flight are finished and committed,
then the worker exits (a graceful drain). A SIGKILLed worker's prompt is reclaimed by another worker's janitor.

Generation: with `rollout.device=cpu` (default) the CPU KV-cache engine of rollout/engine.py
(`rollout.batching.CpuBackend`) with weights dequantized once per version (weight-only formats are exact after dequantization); with `cuda` / `cuda:N` the
packed-weight engine of rollout/cuda_engine.py (`PackedBackend`), built once from the first version's tensors;
each later version of the same layout is copied into it (`PackedEngine.update`: its CUDA graphs, KV cache and
compiled glue stay; what the KV cache held is never read again once the batch drained), and a version of
another layout gets a fresh engine (logged). Never two versions' weights on the GPU at once: the next version
waits in page-locked host memory (`ReceiveBuffers`, reused across versions) until the swap.
"""

from __future__ import annotations

import asyncio
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from broker.codec import PromptGroup, Trajectory, sample_id_for
from broker.health import ROLLOUT_HEALTH, HealthServer
from broker.keys import Keys
from broker.metrics import MetricsEndpoint
from broker.policy_client import (
    FetchCancel,
    FetchCancelled,
    FetchedPolicy,
    PolicyClient,
    PolicyClientConfig,
    ReceiveBuffers,
    check_reachable,
)
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.signing import Signer, policy_token
from broker.streams import PromptQueue, StreamConfig, connect
from policy import manifest as mf
from policy import qat
from policy.chunks import ChecksumMismatch
from policy.contract import contract_from_recipe
from policy.formats import NonFinite
from policy.loop import AsyncConfig
from policy.manifest_check import ManifestRefused, check_manifest, expected_tensors
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.cuda_engine import EngineConfig, PackedEngine, resolve_device
from rollout.fetch_process import FetchProcess, FetchRequest

from .batching import ContinuousBatcher, CpuBackend, GroupResult, PackedBackend
from .config import RolloutConfig
from .prompt_check import PromptRules, check_prompt
from .tasks import Task


class WorkerMetrics:
    """The worker's Prometheus metrics (`tandem_rollout_*`, labelled by nothing: one worker per
    endpoint; Prometheus adds the pod as `instance`)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        import prometheus_client as prom

        self.endpoint = MetricsEndpoint(port, host)
        reg = self.endpoint.registry
        self.groups = prom.Counter(
            "tandem_rollout_groups", "prompt groups generated and committed (groups)", registry=reg
        )
        self.tokens = prom.Counter(
            "tandem_rollout_generated_tokens", "completion tokens generated (tokens)", registry=reg
        )
        self.tokens_per_s = prom.Gauge(
            "tandem_rollout_generated_tokens_per_second",
            "completion tokens per second of generation: the last committed group's tokens over the time "
            "since the previous commit or its own start, whichever is later (tokens/s)",
            registry=reg,
        )
        self.fetch_seconds = prom.Histogram(
            "tandem_rollout_policy_fetch_seconds",
            "time to fetch, verify and load one policy version (seconds)",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=reg,
        )
        self.fetch_bytes = prom.Counter(
            "tandem_rollout_policy_fetch_bytes", "policy tensor bytes fetched over gRPC (bytes)", registry=reg
        )
        self.swap_part = prom.Gauge(
            "tandem_rollout_policy_swap_part_seconds",
            "the last version's swap, by part: receive (gRPC streams), verify (digests after the last chunk), "
            "drain_wait (fetched, waiting for the groups in flight), h2d (copy into the engine or model), "
            "swap (the batcher and bookkeeping) (seconds)",
            ["part"],
            registry=reg,
        )
        self.fetch_failures = prom.Counter(
            "tandem_rollout_policy_fetch_failures", "policy fetches that failed and will be retried", registry=reg
        )
        self.version = prom.Gauge(
            "tandem_rollout_policy_version", "policy version in use (0 before the first)", registry=reg
        )
        self.refused = prom.Counter(
            "tandem_rollout_versions_refused",
            "announced versions refused: a contract fingerprint not this worker's, a manifest it cannot load, "
            "values no quantizer produces, non-finite activations while generating (versions)",
            registry=reg,
        )
        self.distrusted = prom.Counter(
            "tandem_rollout_policy_sources_distrusted",
            "sources that served other content than the signed pointer names (a manifest of another digest, "
            "or bytes not its manifest's): not asked for that version again (sources)",
            registry=reg,
        )
        self.publish_to_live = prom.Gauge(
            "tandem_rollout_publish_to_live_seconds",
            "from the trainer's pointer to the last version (published_at) until it was live here (seconds)",
            registry=reg,
        )
        self.staleness = prom.Gauge(
            "tandem_rollout_policy_staleness",
            "newest announced version minus the version in use, at the last group start (versions)",
            registry=reg,
        )
        self.prompts_refused = prom.Counter(
            "tandem_rollout_prompts_refused",
            "prompt entries dead-lettered by this worker, by why: unsigned (no valid run-secret signature), "
            "malformed (undecodable), invalid (rollout.prompt_check), failed (generating or scoring raised), "
            "redelivered (a poison pill: over rollout.max_prompt_deliveries) (entries)",
            ["why"],
            registry=reg,
        )
        self.port = self.endpoint.port


@dataclass
class _Prefetch:
    """A version being fetched in a thread (or fetched, waiting for the drain)."""

    pointer: PolicyPointer
    cancel: FetchCancel
    task: asyncio.Task  # -> (FetchedPolicy, perf_counter when it was complete)
    seen: float  # perf_counter when the worker started fetching it


class RolloutWorker:
    retry_s = 0.5  # a failed fetch is started again this long after it failed

    def __init__(
        self,
        cfg: RolloutConfig,
        *,
        run_id: str,
        redis_url: str,
        worker_id: str,
        model_config: ModelConfig,
        recipe: Recipe,
        loop: AsyncConfig,
        task: Task,
        group_size: int | None = None,
        redis_outage_s: float = 60.0,
        signer: Signer | None = None,
        log: Callable[[str], None] = print,
    ):
        self.cfg, self.worker_id, self.loop, self.log = cfg, worker_id, loop, log
        self.max_staleness = loop.max_staleness
        self.keys = Keys(run_id=run_id)
        self.redis_url, self.redis_outage_s, self.signer = redis_url, redis_outage_s, signer
        self.task = task
        self.recipe = recipe
        self.device = resolve_device(cfg.device)  # ValueError naming the problem when unusable
        if self.device.type == "cuda" and cfg.memory_fraction:  # processes sharing one GPU (configs/gpu-h200.yaml)
            import torch

            torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, self.device.index or 0)
        self.model_config = model_config
        # CPU: one model whose weights each version overwrites. CUDA: one PackedEngine, updated in place.
        self.model = Transformer(model_config, seed=None) if self.device.type == "cpu" else None
        self.engine: PackedEngine | None = None
        # Where versions are received: on CUDA page-locked memory kept across versions (the engine
        # copies out of it at the swap); on the CPU fresh memory per version (the model's packed
        # tensors alias the fetched bytes, so the next fetch must not overwrite them).
        # With the fetch in a child process (rollout.fetch_process; CUDA's default) they are the
        # child's shared slab: reused across versions on CUDA, fresh per version on the CPU.
        cuda = self.device.type == "cuda"
        in_child = cuda if cfg.fetch_process is None else cfg.fetch_process
        self.fetcher = (
            FetchProcess(
                pinned=cuda,
                reuse=cuda,
                processes=cfg.fetch_processes,
                log=lambda line: self.log(f"{self.worker_id}: {line}"),
            )
            if in_child
            else None
        )
        self.host_buffers = self.fetcher.buffers if in_child else ReceiveBuffers(pinned=True) if cuda else None
        self._prefetch: _Prefetch | None = None
        self._retry_at = 0.0  # monotonic time before which a failed fetch is not started again
        self.batcher: ContinuousBatcher | None = None  # made at the first version, swapped per version
        self.inflight: dict = {}  # group_id -> (prompt record or None, its PromptGroup, start time)
        self.fingerprint = contract_from_recipe(model_config=model_config, recipe=recipe).fingerprint()
        self.version: int | None = None
        self._refused: int | None = None  # last version refused for its fingerprint (logged once)
        # What a loadable manifest declares (checked before anything is allocated), and the versions
        # refused for not matching it: immutable, so never fetched again.
        self.expected = expected_tensors(recipe.plan(model_config))
        self.refused_versions: set[int] = set()
        # (version, source address, content digest) whose source served other content than the signed pointer
        # names: the pointer is authentic, the source is not; it is not asked for that version again.
        self.distrusted: set[tuple[int, str, str]] = set()
        self._fetch_error = ""  # the last fetch failure logged (why()), until a fetch succeeds
        self.groups_done = 0
        # What a prompt group must satisfy before it reaches the engine (rollout.prompt_check), with
        # `group_size` the run's (trainer.group_size; None: any up to max_batch).
        kv = model_config.max_seq_len if self.device.type == "cpu" else min(cfg.kv_capacity, model_config.max_seq_len)
        self.prompt_rules = PromptRules(
            vocab_size=model_config.vocab_size,
            max_seq_len=kv,
            max_new_tokens=task.max_new_tokens,
            max_batch=cfg.max_batch,
            group_size=group_size,
        )
        self.refused_prompts: dict[str, int] = {}  # why -> prompt entries dead-lettered (metrics' labels)
        self._isolate: set[str] = set()  # group ids that failed in company: retried one at a time
        self._since_swap = [0, 0, 0.0]  # groups, completion tokens, generating seconds under the version in use
        self.stop = asyncio.Event()
        # NOT_SERVING until a verified policy is loaded, and again from SIGTERM on (draining).
        self.health = HealthServer(port=cfg.health.port, service=ROLLOUT_HEALTH, host=cfg.health.host)
        self.metrics = WorkerMetrics(cfg.metrics_port, cfg.metrics_host)
        if cfg.tls.enabled:  # missing TLS files: fail at start, not at every fetch
            PolicyClientConfig(address="tls-files-check:1", tls=cfg.tls)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        self.health.set_serving(False)
        self.stop.set()

    async def run(self) -> int:
        if self.health.start() is not None:
            self.log(f"{self.worker_id}: health (grpc.health.v1) on {self.health.host}:{self.health.port}")
        if self.metrics.port is not None:
            self.log(f"{self.worker_id}: metrics (Prometheus) on port {self.metrics.port}")
        self.redis = connect(self.redis_url, outage_s=self.redis_outage_s, log=self.log)
        registry = PolicyRegistry(self.redis, self.keys, signer=self.signer)  # refuses unsigned pointers
        queue = PromptQueue(
            self.redis,
            self.keys,
            signer=self.signer,
            consumer=self.worker_id,
            config=prompt_stream_config(self.cfg),
        )
        await queue.setup()
        beats = asyncio.create_task(
            Heartbeats(self.redis, self.keys).run(
                self.worker_id,
                role="rollout",
                stop=self.stop,
                interval_s=self.cfg.heartbeat_s,
                ttl_s=self.cfg.heartbeat_ttl_s,
                info=lambda: {
                    "version": self.version,
                    "groups": self.groups_done,
                    "refused_versions": len(self.refused_versions),
                    "refused_prompts": sum(self.refused_prompts.values()),
                    "distrusted_sources": len(self.distrusted),
                },
            )
        )
        carried: list = []  # prompt records read but not started (the newest policy was unreachable)
        refused_logged = regrouped_logged = 0
        last_pointer = last_read = last_commit = last_keep = 0.0
        try:
            while not (self.stop.is_set() and not self.inflight):
                now = time.monotonic()
                busy = bool(self.inflight)
                fetched = self._prefetch is not None and self._prefetch.task.done()
                swap_now = fetched and (self.batcher is None or self.batcher.drained)
                if not busy or swap_now or now - last_pointer >= 0.25:  # generating: a few looks a second
                    last_pointer = now
                    latest = await registry.latest()
                    if registry.refused > refused_logged:
                        if refused_logged == 0 or registry.refused % 100 == 0:
                            self.log(
                                f"{self.worker_id}: refusing policy:latest: malformed or not signed with this run's secret"
                            )
                        refused_logged = registry.refused
                    if latest is not None and (self.version is None or latest.version > self.version):
                        await self._swap_when_drained(latest)  # on failure keep the current one
                    elif latest is not None and self._prefetch is not None:  # the pointer went back (a restart)
                        await self._give_up_prefetch()
                if self.version is None:
                    if carried and time.monotonic() - last_keep >= self.cfg.reclaim_idle_s / 4:
                        last_keep = time.monotonic()  # groups given back by a refused version: still ours
                        await queue.keep_alive(carried)
                    await self._wait_prefetch(0.5)
                    continue
                room = self.cfg.max_inflight_groups - len(self.inflight)
                if not self.stop.is_set() and room > 0 and (not busy or now - last_read >= 0.1):
                    last_read = now
                    if not carried:  # do not block while samples are decoding or a version is coming
                        block = 0 if busy or self._prefetch is not None else None
                        carried = await queue.read(count=room, block_ms=block)
                        self._count_queue_refusals(queue)
                        if queue.counters.regrouped > regrouped_logged:  # read or keep_alive found it gone
                            regrouped_logged = queue.counters.regrouped
                            self.log(f"{self.worker_id}: Redis had lost the prompts stream or its group: made again")
                    while carried and len(self.inflight) < self._inflight_limit(carried):
                        reason = self._refusal(carried[0].group)
                        if reason is not None:
                            await self._refuse(queue, carried.pop(0), "invalid", reason)
                            continue
                        # Never start a group with a policy already more than max_staleness behind
                        # the newest; if the newest cannot be loaded now (or the groups in flight
                        # must drain first), keep the entries and retry (re-reading the pointer: a
                        # restarted trainer publishes a new address).
                        latest = await registry.latest()
                        stale = latest is not None and latest.version - self.version > self.max_staleness
                        if stale and not await self._swap_when_drained(latest):
                            await queue.keep_alive(carried)  # still ours: no other janitor claims them
                            if not self.inflight:
                                await self._wait_prefetch(0.5)
                            break
                        if latest is not None:
                            self.metrics.staleness.set(latest.version - self.version)
                        rec = carried.pop(0)
                        try:
                            self._submit(rec.group, rec)
                        except ValueError as e:  # the backend's own fit check (prompt_check should say first)
                            await self._refuse(queue, rec, "invalid", why(e))
                if self.inflight:
                    if time.monotonic() - last_keep >= self.cfg.reclaim_idle_s / 4:
                        last_keep = time.monotonic()
                        await queue.keep_alive([r for r, _, _ in self.inflight.values() if r is not None])
                    for result in await self._step(queue, carried):
                        rec, group, t0 = self.inflight.pop(result.key)
                        self._isolate.discard(group.group_id)
                        try:
                            trajectories = self._trajectories(group, result)
                        except Exception as e:  # e.g. the task's verifier on fields it did not check
                            await self._refuse(queue, rec, "failed", f"scoring or packing its samples raised {why(e)}")
                            continue
                        n_tokens = sum(len(t.completion_tokens) for t in trajectories)
                        t1 = time.perf_counter()
                        gen_s = t1 - max(t0, last_commit)  # generating time this group adds to the run
                        self.metrics.tokens_per_s.set(n_tokens / max(gen_s, 1e-9))
                        last_commit = t1
                        g = self._since_swap
                        g[0], g[1], g[2] = g[0] + 1, g[1] + n_tokens, g[2] + gen_s
                        await queue.complete(rec, trajectories)
                        self.groups_done += 1
                        self.metrics.groups.inc()
                        self.metrics.tokens.inc(n_tokens)
                    await asyncio.sleep(0)  # heartbeats and signals between decode chunks
                if self._prefetch is not None and (self.batcher is None or self.batcher.drained):
                    await self._wait_prefetch(0.05)  # nothing decoding: wait for the fetch, do not spin
            self.log(f"{self.worker_id}: drained after {self.groups_done} groups")
            return 0
        finally:
            self.stop.set()
            await self._drop_prefetch()
            if self.fetcher is not None:
                self.fetcher.close()
            await beats
            await self.redis.aclose()
            self.health.stop()
            self.metrics.endpoint.close()

    def _refusal(self, group: PromptGroup) -> str | None:
        """Why this worker cannot run `group` (rollout.prompt_check, with the task's own field check)."""
        return check_prompt(group, self.prompt_rules, check_fields=getattr(self.task, "check_fields", None))

    def _inflight_limit(self, carried: list) -> int:
        """Groups that may be in flight: one while a group that failed in company waits or runs."""
        suspect = self._isolate & ({r.group.group_id for r in carried} | set(self.inflight))
        return 1 if suspect else self.cfg.max_inflight_groups

    async def _step(self, queue: PromptQueue, carried: list) -> list[GroupResult]:
        """One batcher step. Non-finite values refuse the live version (`_refuse_live`). If it raises
        otherwise, the batch is dropped (a fresh batcher on the same weights):
        a group that was alone in it is dead-lettered with the error; groups that were in company go
        back to the front of `carried`, to be retried one at a time (`_isolate`)."""
        try:
            return self.batcher.step()
        except NonFinite as e:  # what the live version computes: refused, never a crash
            carried[:0] = self._refuse_live(e)
            return []
        except Exception as e:
            failed = list(self.inflight.values())
            self.inflight.clear()
            self.batcher = ContinuousBatcher(
                self._backend(), max_inflight_groups=self.cfg.max_inflight_groups, version=self.version
            )
            if len(failed) == 1:
                self._isolate.discard(failed[0][1].group_id)
                await self._refuse(queue, failed[0][0], "failed", f"generating raised {why(e)}")
            else:
                self.log(f"{self.worker_id}: a batch of {len(failed)} groups raised {why(e)}: retrying each alone")
                self._isolate.update(g.group_id for _, g, _ in failed)
                carried[:0] = [rec for rec, _, _ in failed if rec is not None]
            return []

    async def _refuse(self, queue: PromptQueue, rec, kind: str, reason: str) -> None:
        """Dead-letter a prompt group this worker cannot run (acked with it: never handed out again),
        count it and log one line."""
        if rec is not None:
            await queue.dead_letter(rec, f"{kind}: {reason}")
        group_id = rec.group.group_id[:80] if rec is not None else "?"
        self._count_refusal(kind, 1, f"prompt {group_id!r}: {kind}: {reason}")

    def _count_queue_refusals(self, queue: PromptQueue) -> None:
        """Move what the queue dead-lettered on its own (signatures, decoding, poison pills) into the metrics."""
        c = queue.counters
        for name, kind in (("unsigned", "unsigned"), ("malformed", "malformed"), ("dead_lettered", "redelivered")):
            n = getattr(c, name)
            if n:
                setattr(c, name, 0)
                self._count_refusal(
                    kind, n, f"{n} prompt entr{'y' if n == 1 else 'ies'} ({kind}; reasons in the dead letters)"
                )

    def _count_refusal(self, kind: str, n: int, what: str) -> None:
        """Count `n` dead-lettered prompt entries; one log line each, the first 10 and every 1000th."""
        before = sum(self.refused_prompts.values())
        self.refused_prompts[kind] = self.refused_prompts.get(kind, 0) + n
        self.metrics.prompts_refused.labels(kind).inc(n)
        if before < 10 or (before + n) // 1000 > before // 1000:  # a flood is not a log flood
            self.log(f"{self.worker_id}: dead-lettered {what} (#{before + n} refused)")

    async def _swap_when_drained(self, pointer: PolicyPointer) -> bool:
        """Make `pointer`'s version live as soon as it is fetched and no started group is in flight
        (True when it is live now). Until then: its fetch runs in the background (started here, or
        replacing the fetch of an older pointer) and no group starts, so the started ones drain.
        A failed fetch is logged at once, groups start again under the current version, and the
        next call retries it."""
        if not self._loadable(pointer):
            await self._give_up_prefetch()  # the newest is not for us: an older fetch is not either
            return False
        pf = await self._start_prefetch(pointer)
        if pf is None:  # a failed fetch waits a moment before its retry
            return False
        failed = pf.task.done() and pf.task.exception() is not None  # logged now, not after the drain
        if not failed and (not pf.task.done() or (self.batcher is not None and not self.batcher.drained)):
            if self.batcher is not None:
                self.batcher.request_swap()
            return False
        return await self._finish_or_log(pf)

    async def _try_load(self, pointer: PolicyPointer | None) -> bool:
        """Load `pointer`'s version now (fetch, then swap: no group may be in flight); False
        (logged) when it is not for our contract or not reachable now, e.g. a trainer that
        restarted and has not republished yet."""
        if not self._loadable(pointer):
            return False
        pf = await self._start_prefetch(pointer, now=True)
        await asyncio.wait({pf.task})
        return await self._finish_or_log(pf)

    def _loadable(self, pointer: PolicyPointer | None) -> bool:
        """False for a version refused before or a contract fingerprint not ours (logged once)."""
        if pointer is None or pointer.version in self.refused_versions:
            return False
        if (pointer.version, self._source(pointer), pointer.content_digest) in self.distrusted:
            return False  # wait for another source: a new pointer (a newer version, or this one elsewhere)
        if pointer.contract_fingerprint != self.fingerprint:
            if pointer.version != self._refused:
                self._refused = pointer.version
                self.metrics.refused.inc()
                self.log(
                    f"{self.worker_id}: refusing v{pointer.version}: contract fingerprint "
                    f"{pointer.contract_fingerprint[:12]} is not ours ({self.fingerprint[:12]})"
                )
            return False
        return True

    async def _start_prefetch(self, pointer: PolicyPointer, *, now: bool = False) -> _Prefetch | None:
        """The background fetch of `pointer`'s version: the one running, else a new one (an older
        pointer's fetch is cancelled first: one fetch at a time, into the same host buffers).
        None while a failed fetch waits for its retry (`now` skips that wait)."""
        pf = self._prefetch
        if pf is not None and pf.pointer == pointer:
            return pf
        if not now and time.monotonic() < self._retry_at:
            return None
        if pf is not None:
            done = "fetched" if pf.task.done() else "fetching"
            self.log(f"{self.worker_id}: v{pointer.version} announced while {done} v{pf.pointer.version}: superseded")
        await self._drop_prefetch()
        cancel = FetchCancel()
        task = asyncio.create_task(asyncio.to_thread(self._fetch, pointer, cancel))
        self._prefetch = _Prefetch(pointer, cancel, task, time.perf_counter())
        return self._prefetch

    async def _drop_prefetch(self) -> None:
        """Cancel the fetch in progress (if any) and wait for its thread to let go of the buffers."""
        pf, self._prefetch = self._prefetch, None
        if pf is not None:
            pf.cancel.cancel()
            await asyncio.wait({pf.task})
            if not pf.task.cancelled():
                pf.task.exception()  # retrieved: a superseded fetch's error is not news

    async def _give_up_prefetch(self) -> None:
        """Drop the fetch (if any) and start groups again under the current version."""
        if self._prefetch is not None:
            await self._drop_prefetch()
            if self.batcher is not None:
                self.batcher.cancel_swap()

    async def _wait_prefetch(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, less if the version being fetched comes in first."""
        pf = self._prefetch
        if pf is None or pf.task.done():
            await asyncio.sleep(timeout if pf is None else 0)
        else:
            await asyncio.wait({pf.task}, timeout=timeout)

    def _fetch(self, pointer: PolicyPointer, cancel: FetchCancel) -> tuple[FetchedPolicy, float]:
        """The fetch thread: the verified version (bytes in `host_buffers` on CUDA), fetched by the
        child process (`fetcher`) or here."""
        request = FetchRequest(
            address=self._source(pointer),
            fingerprint=self.fingerprint,
            version=pointer.version,
            digest=pointer.content_digest,
            fetch_timeout_s=self.cfg.fetch_timeout_s,
            streams=self.cfg.fetch_streams,
            tls=self.cfg.tls,
            run_token=policy_token(self.signer),
        )
        if self.fetcher is not None:
            fetched = self.fetcher.fetch(request, check=self._check_manifest, cancel=cancel)
            return fetched, time.perf_counter()
        # A trainer gone from this address (a restart; the pointer outlived it in Redis) fails
        # here at once, so the next pointer is seen within a loop, not after fetch_timeout_s.
        check_reachable(request.address)
        with PolicyClient(request.client_config()) as client:
            fetched = client.fetch(
                pointer.version,
                digest=pointer.content_digest,
                check=self._check_manifest,
                buffers=self.host_buffers,
                cancel=cancel,
            )
        return fetched, time.perf_counter()

    async def _finish_or_log(self, pf: _Prefetch) -> bool:
        """`_finish`; False (logged, counted; groups resume under the current version) on failure."""
        pointer = pf.pointer
        try:
            await self._finish(pf)
            self._fetch_error = ""
            return True
        except ManifestRefused as e:
            self.refused_versions.add(pointer.version)
            self.metrics.refused.inc()
            self.log(
                f"{self.worker_id}: {str(e)[:400]}; keeping v{self.version} "
                f"({len(self.refused_versions)} version(s) refused)"
            )
        except (mf.DigestMismatch, ChecksumMismatch) as e:
            # Bytes that fail an authenticated manifest (after the client's own re-fetches) are the
            # source's fault, as another manifest is; without a digest the manifest proves nothing.
            if isinstance(e, mf.DigestMismatch) or pointer.content_digest:
                self._distrust(pointer, e)
            else:
                self._retry_later(pointer, e)
        except FetchCancelled:
            pass
        except (grpc.RpcError, ValueError, OSError) as e:  # ValueError: checksum/manifest problems
            self._retry_later(pointer, e)
        if self.batcher is not None:
            self.batcher.cancel_swap()  # not loadable now: go on with the current version
        return False

    async def _finish(self, pf: _Prefetch) -> None:
        """Swap a fetched version in: copied into the engine (or the CPU model), then the batcher."""
        if self._prefetch is pf:
            self._prefetch = None
        fetched, fetched_at = pf.task.result()  # raises the fetch's error
        if self.batcher is not None and not self.batcher.drained:
            raise RuntimeError("policy swap while groups are in flight")  # the loop drains first
        t0 = time.perf_counter()
        how = "cpu model"
        if self.model is not None:
            qat.install_packed(self.model, self.recipe, fetched.tensors)
        elif self.engine is not None and await asyncio.to_thread(self.engine.update, fetched.tensors):
            how = "in place"
        else:
            if self.engine is not None:
                self.log(f"{self.worker_id}: v{fetched.version} has another tensor layout: building a fresh engine")
            self.engine = None  # free the previous version's weights, KV cache and graphs first
            if self.batcher is not None:
                self.batcher.backend = None
            try:
                self.engine = await asyncio.to_thread(self._build_engine, fetched.tensors)
            except BaseException:
                self.version = None  # the old engine is gone: serve nothing until a version loads
                raise
            how = "fresh engine"
        t1 = time.perf_counter()
        if self.batcher is None:
            self.batcher = ContinuousBatcher(
                self._backend(), max_inflight_groups=self.cfg.max_inflight_groups, version=fetched.version
            )
        else:  # the same backend unless the engine was built anew
            self.batcher.swap(fetched.version, self._backend() if how == "fresh engine" else None)
        previous, self.version = self.version, fetched.version
        t2 = time.perf_counter()
        st = fetched.stats
        parts = {
            "receive": st.receive_s,
            "verify": st.verify_s,
            "drain_wait": max(0.0, t0 - fetched_at),
            "h2d": t1 - t0,
            "swap": t2 - t1,
        }
        for part, sec in parts.items():
            self.metrics.swap_part.labels(part).set(sec)
        # The pointer's published_at is the trainer's clock: exact on one machine, skewed across hosts.
        pointer = pf.pointer
        after_publish = time.time() - pointer.published_at if pointer.published_at else None  # None: not said
        self.metrics.fetch_seconds.observe(st.seconds + parts["h2d"])
        self.metrics.fetch_bytes.inc(st.bytes)
        self.metrics.version.set(self.version)
        if after_publish is not None:
            self.metrics.publish_to_live.set(after_publish)
        self.health.set_serving(not self.stop.is_set())
        groups, tokens, gen_s = self._since_swap
        self._since_swap = [0, 0, 0.0]
        self.log(
            f"{self.worker_id}: policy v{self.version} live ({st.bytes} bytes, "
            f"{t2 - pf.seen:.2f}s, {'?' if after_publish is None else f'{after_publish:.2f}'}s after publish); "
            f"under v{previous}: {groups} groups, {tokens} tokens in {gen_s:.2f}s generating; "
            + ", ".join(f"{k} {v:.2f}s" for k, v in parts.items())
            + f" ({how}, {self.cfg.fetch_streams} stream(s))"
        )

    def _check_manifest(self, manifest) -> None:
        check_manifest(manifest, self.expected, max_total_bytes=self.cfg.max_policy_bytes)

    def _retry_later(self, pointer: PolicyPointer, e: BaseException) -> None:
        """Count a failed fetch and retry it in `retry_s`; the same failure again (a TLS setting, ...) is
        counted, not logged."""
        self.metrics.fetch_failures.inc()
        self._retry_at = time.monotonic() + self.retry_s
        if why(e) != self._fetch_error:
            self._fetch_error = why(e)
            self.log(
                f"{self.worker_id}: fetching v{pointer.version} from {self._source(pointer)} failed, "
                f"will retry (the same error again is not logged): {why(e)}"
            )

    def _distrust(self, pointer: PolicyPointer, e: BaseException) -> None:
        source = self._source(pointer)
        self.distrusted.add((pointer.version, source, pointer.content_digest))
        self.metrics.distrusted.inc()
        self.log(
            f"{self.worker_id}: refusing v{pointer.version} from {source}: {why(e)}; not asking it for "
            f"v{pointer.version} again, keeping v{self.version}"
        )

    def _source(self, pointer: PolicyPointer) -> str:
        """Where `pointer`'s version is fetched from (the pointer's address unless configured)."""
        return self.cfg.policy_address or pointer.address

    def _refuse_live(self, e: NonFinite) -> list:
        """The live version computed non-finite values while generating: refused as if at fetch (never
        loaded again), nothing served until a newer one is live. Returns the records of the groups in
        flight, to start again under the next version (their samples so far are dropped)."""
        v, self.version = self.version, None
        self.refused_versions.add(v)
        self.metrics.refused.inc()
        self.metrics.version.set(0)
        self.health.set_serving(False)
        records = [rec for rec, _, _ in self.inflight.values() if rec is not None]
        self.inflight.clear()
        self.batcher = None  # its scheduler and backend hold that version's rows: a new one at the next swap
        self.log(
            f"{self.worker_id}: v{v} refused while generating: {why(e)}; serving nothing until a newer "
            f"version is live, {len(records)} group(s) kept for it"
        )
        return records

    def _build_engine(self, tensors: dict) -> PackedEngine:
        import torch

        engine = PackedEngine(
            self.model_config,
            self.recipe.plan(self.model_config),
            tensors,
            device=self.device,
            engine=EngineConfig(
                max_batch=self.cfg.max_batch, max_seq_len=min(self.cfg.kv_capacity, self.model_config.max_seq_len)
            ),
        )
        engine.capture()
        torch.cuda.synchronize(self.device)
        return engine

    def _backend(self):
        """The batcher's backend for the version just loaded: the CPU model or the new PackedEngine."""
        kw = dict(temperature=self.loop.temperature, pad_id=self.task.tokenizer.pad_id)
        eos = self.task.tokenizer.eos_id
        stop = set() if eos is None else {eos}
        if self.engine is None:
            return CpuBackend(self.model, slots=self.cfg.max_batch, stop=stop, **kw)
        return PackedBackend(self.engine, stop=stop, **kw)

    def _submit(self, group: PromptGroup, record=None) -> None:
        """Hand a prompt group to the batcher: n samples, sample i seeded by crc32 of its sample id."""
        seeds = [zlib.crc32(sample_id_for(group.group_id, i).encode()) for i in range(group.n_samples)]
        self.batcher.submit(
            group.group_id, group.prompt_tokens.tolist(), seeds, max_new_tokens=self.task.max_new_tokens
        )
        self.inflight[group.group_id] = (record, group, time.perf_counter())

    def _rollout_group(self, group: PromptGroup) -> list[Trajectory]:
        """One group alone, start to finish, with the version in use (the loop interleaves many)."""
        if self.inflight:
            raise RuntimeError("_rollout_group needs an idle worker")
        self._submit(group)
        while True:
            for result in self.batcher.step():
                _, group, _ = self.inflight.pop(result.key)
                return self._trajectories(group, result)

    def _trajectories(self, group: PromptGroup, result: GroupResult) -> list[Trajectory]:
        n = group.n_samples
        prompt = group.prompt_tokens.tolist()
        now = time.time()
        out = []
        for i, (completion, logps) in enumerate(zip(result.tokens, result.logprobs)):
            out.append(
                Trajectory(
                    sample_id=sample_id_for(group.group_id, i),
                    prompt_id=group.prompt_id,
                    group_id=group.group_id,
                    sample_index=i,
                    group_size=n,
                    prompt_tokens=np.asarray(prompt, dtype=np.int32),
                    completion_tokens=np.asarray(completion, dtype=np.int32),
                    behavior_logprobs=np.asarray(logps, dtype=np.float32),
                    reward=self.task.score(completion, group.task),
                    policy_version=result.version,  # the version that started the group: all its tokens
                    contract_fingerprint=self.fingerprint,
                    worker_id=self.worker_id,
                    created_at=now,
                )
            )
        return out


def prompt_stream_config(cfg: RolloutConfig) -> StreamConfig:
    """How a worker reads the prompts stream: one entry at a time; entries of a worker dead for
    `reclaim_idle_s` are claimed, and one handed out more than `max_prompt_deliveries` times (every
    holder died: a poison pill) is dead-lettered on reclaim instead."""
    return StreamConfig(
        read_count=1,
        block_ms=cfg.read_block_ms,
        claim_idle_ms=int(cfg.reclaim_idle_s * 1000),
        janitor_every_s=min(5.0, cfg.reclaim_idle_s / 2),
        max_deliveries=cfg.max_prompt_deliveries,
    )


def why(e: BaseException) -> str:
    """One line for a log: a gRPC error's status code and details (its str() is a multi-line
    dump whose first line says nothing), else the exception's type and first line."""
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        details = (e.details() or "").replace("\n", " ")
        return f"gRPC {e.code().name}: {details[:300]}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
