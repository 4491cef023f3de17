"""The rollout worker: prompt groups in, scored trajectory groups out, always with a verified policy.

Loop (`RolloutWorker.run`; up to `rollout.max_inflight_groups` groups in flight):
    newest policy pointer -> `offer` it to the version swap (rollout/swap.py);
    room for a group? -> read prompt groups (own pending, reclaimed, new) -> dead-letter one this
        worker cannot run (rollout/prompt_check.py) -> none started under a version older than its
        `min_version` or more than `max_staleness` behind the newest -> `submit` to the batcher
        (rollout/batching.py);
    `step` the batcher -> score a finished group -> XADD its trajectories and XACK its prompt in one
        transaction.
A group whose generation or scoring raises is dead-lettered with the error's line; a live version
computing non-finite values is refused and its groups start again under the next. SIGTERM: no new
groups, the ones in flight finished and committed, then exit. Nothing a peer serves ends the worker.
Fetches ask the pointer's sources in order and `rollout.relay` serves each verified version to peers
(rollout/fetching.py). Engines: rollout/engine.py (CPU), rollout/packed_engine.py
(CUDA, updated in place). Metrics: rollout/metrics.py."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from broker.codec import PromptGroup, Trajectory, sample_id_for
from broker.health import ROLLOUT_HEALTH, HealthServer
from broker.keys import Keys
from broker.policy_client import FetchCancel, FetchCancelled, FetchedPolicy
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.signing import Signer
from broker.streams import PromptQueue, StreamConfig, connect
from policy import qat
from policy.contract import contract_from_recipe
from policy.formats import NonFinite
from policy.loop import AsyncConfig
from policy.manifest_check import expected_tensors
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from policy.tracing import StepTracer
from rollout.packed_engine import EngineConfig, PackedEngine, resolve_device

from .batching import ContinuousBatcher, GroupResult, ModelBackend, PackedBackend, stale_kv_tokens
from .config import RolloutConfig
from .fetching import PolicyFetcher
from .metrics import WorkerMetrics, WorkerStats
from .prompt_check import PromptRules, check_prompt
from .swap import Pending, VersionSwap, why
from .tasks import Task

__all__ = ["Finished", "RolloutWorker", "decode_stream", "prompt_stream_config", "why"]


@dataclass(frozen=True)
class Finished:
    """A group the batcher finished: its trajectories, or (`error`) what scoring them raised."""

    record: object  # the prompt record it was read as (None: submitted without one)
    group: PromptGroup
    started: float  # perf_counter when it was submitted
    trajectories: list[Trajectory]
    error: Exception | None = None


@dataclass
class _FetchJob:
    """The thread fetching the swap's pending version (`VersionSwap.pending`)."""

    cancel: FetchCancel
    task: asyncio.Task  # -> (FetchedPolicy, perf_counter when it was complete, the source it came from)


class RolloutWorker:
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
        self.device = _device(cfg)
        self.model_config = model_config
        self.model = _model(model_config, self.device, exact=loop.exact)
        self.engine: PackedEngine | None = None
        self.fingerprint = contract_from_recipe(model_config=model_config, recipe=recipe).fingerprint()
        self.swap = VersionSwap(
            fingerprint=self.fingerprint, policy_address=cfg.policy_address, inflight=loop.inflight_updates
        )
        self._job: _FetchJob | None = None
        self.stats = WorkerStats()
        self.fetching = PolicyFetcher(
            cfg,
            worker_id=worker_id,
            fingerprint=self.fingerprint,
            expected=expected_tensors(recipe.plan(model_config)),  # what a loadable manifest declares
            cuda=self.device.type == "cuda",
            swap=self.swap,
            stats=self.stats,
            signer=signer,
            log=lambda line: self.log(line),  # the worker's log, whatever it is set to later
        )
        self.batcher: ContinuousBatcher | None = None  # made at the first version, swapped per version
        self.inflight: dict = {}  # group_id -> (prompt record or None, its PromptGroup, start time)
        self.prompt_rules = self._prompt_rules(group_size)
        self._isolate: set[str] = set()  # group ids that failed in company: retried one at a time
        self._requeue: list = []  # prompt records of groups given back (started again from the front)
        self._since_swap = [0, 0, 0.0]  # groups, completion tokens, generating seconds under the version in use
        # The loop's clocks (monotonic, except _committed_at: perf_counter) and what it logged last.
        self._pointer_at = self._read_at = self._kept_at = self._committed_at = 0.0
        self._pointers_refused = self._regrouped = 0
        self.stop = asyncio.Event()
        # NOT_SERVING until a verified policy is loaded, and again from SIGTERM on (draining).
        self.health = HealthServer(port=cfg.health.port, service=ROLLOUT_HEALTH, host=cfg.health.host)
        self.tracer = StepTracer(cfg.trace, worker_id, self.device, log)
        self._decode_stream = decode_stream(cfg, self.device)
        self.metrics = WorkerMetrics(cfg.metrics_port, cfg.metrics_host, self.metric_values)

    def _prompt_rules(self, group_size: int | None) -> PromptRules:
        """What a prompt group must satisfy before it reaches the engine (rollout.prompt_check), with
        `group_size` the run's (trainer.group_size; None: any up to max_batch)."""
        mc = self.model_config
        kv = mc.max_seq_len if self.device.type == "cpu" else min(self.cfg.kv_capacity, mc.max_seq_len)
        return PromptRules(
            vocab_size=mc.vocab_size,
            max_seq_len=kv,
            max_new_tokens=self.task.max_new_tokens,
            max_batch=self.cfg.max_batch,
            group_size=group_size,
        )

    @property
    def version(self) -> int | None:
        """The live policy version (None before the first, and after the live one was refused)."""
        return self.swap.live

    def metric_values(self) -> dict:
        """Every number rollout/metrics.py exports (called from the metrics endpoint's thread). The live
        version is read first: a version's bytes are counted when its fetch ends, before it goes live,
        so a scrape that sees it live also sees them."""
        s, w = self.stats, self.swap
        live = w.live or 0
        return {
            "groups": s.groups,
            "generated_tokens": s.generated_tokens,
            "policy_fetch_bytes": s.policy_fetch_bytes,
            "policy_delta_fetches": s.policy_delta_fetches,
            "policy_deltas_refused": s.policy_deltas_refused,
            "policy_fetch_failures": w.fetch_failures,
            "versions_refused": w.versions_refused,
            "policy_sources_distrusted": w.sources_distrusted,
            "tokens_on_stale_kv": s.tokens_on_stale_kv,
            "inflight_swaps": s.inflight_swaps,
            "policy_relay_fetches": s.policy_relay_fetches,
            "policy_relay_fallbacks": s.policy_relay_fallbacks,
            "relay_sent_bytes": self.fetching.relay_sent_bytes(),
            "relay_versions_offered": s.relay_versions_offered,
            "policy_version": live,
            "generated_tokens_per_second": s.generated_tokens_per_second,
            "policy_staleness": s.policy_staleness,
            "publish_to_live_seconds": s.publish_to_live_seconds,
            "prompts_refused": dict(s.prompts_refused),
            "swap_part_seconds": s.swap_part_seconds,
        }

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        self.health.set_serving(False)
        self.stop.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> int:
        """The loop of the module docstring, until `request_stop` and the groups in flight are committed."""
        registry, queue, beats = await self._connect()
        carried: list = []  # prompt records read but not started (the newest policy was unreachable)
        try:
            while not (self.stop.is_set() and not self.inflight):
                now = time.monotonic()
                busy = bool(self.inflight)
                installable = self.swap.fetched and (self.swap.inflight or self._drained())
                if not busy or installable or now - self._pointer_at >= 0.25:
                    self._pointer_at = now  # generating: a few looks a second
                    await self._follow_pointer(registry)
                if self._requeue:  # groups an engine rebuilt under them lost: start them again first
                    carried[:0], self._requeue = self._requeue, []
                if self.version is None:
                    if carried:  # groups given back by a refused version: still ours
                        await self._keep_alive(queue, carried)
                    await self.wait_fetch(0.5)
                    continue
                room = self.cfg.max_inflight_groups - len(self.inflight)
                if not self.stop.is_set() and room > 0 and (not busy or now - self._read_at >= 0.1):
                    self._read_at = now
                    if not carried:
                        carried = await self._read(queue, room, busy)
                    await self._start_groups(queue, registry, carried)
                if self.inflight:
                    await self._keep_alive(queue, [r for r, _, _ in self.inflight.values() if r is not None])
                    await self._commit(queue, await self._generate(queue, carried))
                    await asyncio.sleep(0)  # heartbeats and signals between decode chunks
                if self.swap.pending is not None and self._drained():
                    await self.wait_fetch(0.05)  # nothing decoding: wait for the fetch, do not spin
            self.log(f"{self.worker_id}: drained after {self.stats.groups} groups")
            return 0
        finally:
            await self._close(beats)

    async def _connect(self) -> tuple[PolicyRegistry, PromptQueue, asyncio.Task]:
        """Health and metrics endpoints up, Redis connected: the policy registry (it refuses unsigned
        pointers), the prompt queue and the heartbeat task."""
        if self.health.start() is not None:
            self.log(f"{self.worker_id}: health (grpc.health.v1) on {self.health.host}:{self.health.port}")
        if self.metrics.port is not None:
            self.log(f"{self.worker_id}: metrics (Prometheus) on port {self.metrics.port}")
        if self.cfg.relay:
            self.fetching.start_relay()
        self.redis = connect(self.redis_url, outage_s=self.redis_outage_s, log=self.log)
        registry = PolicyRegistry(self.redis, self.keys, signer=self.signer)
        queue = PromptQueue(
            self.redis, self.keys, signer=self.signer, consumer=self.worker_id, config=prompt_stream_config(self.cfg)
        )
        await queue.setup()
        beats = Heartbeats(self.redis, self.keys).run(
            self.worker_id,
            role="rollout",
            stop=self.stop,
            interval_s=self.cfg.heartbeat_s,
            ttl_s=self.cfg.heartbeat_ttl_s,
            info=lambda: {
                "version": self.version,
                "groups": self.stats.groups,
                "refused_versions": len(self.swap.refused_versions),
                "refused_prompts": sum(self.stats.prompts_refused.values()),
                "distrusted_sources": len(self.swap.distrusted),
                **({"relay": self.fetching.relay_address} if self.fetching.relay_address else {}),
            },
        )
        return registry, queue, asyncio.create_task(beats)

    async def _close(self, beats: asyncio.Task) -> None:
        self.stop.set()
        await self._cancel_fetch()
        self.fetching.close()
        await beats
        await self.redis.aclose()
        self.health.stop()
        self.metrics.close()

    async def _follow_pointer(self, registry: PolicyRegistry) -> None:
        """Offer the newest pointer when it is newer than the live version, or when a fetch is pending
        (a pointer that went back, a restarted trainer's, drops it)."""
        latest = await registry.latest()
        if registry.refused > self._pointers_refused:
            if self._pointers_refused == 0 or registry.refused % 100 == 0:
                self.log(f"{self.worker_id}: refusing policy:latest: malformed or not signed with this run's secret")
            self._pointers_refused = registry.refused
        if latest is not None and (
            self.version is None or latest.version > self.version or self.swap.pending is not None
        ):
            await self.offer(latest)  # on failure keep the current one

    async def _read(self, queue: PromptQueue, room: int, busy: bool) -> list:
        """Up to `room` prompt records; no blocking while samples are decoding or a version is coming."""
        records = await queue.read(count=room, block_ms=0 if busy or self.swap.pending is not None else None)
        self._count_queue_refusals(queue)
        if queue.counters.regrouped > self._regrouped:  # read or keep_alive found it gone
            self._regrouped = queue.counters.regrouped
            self.log(f"{self.worker_id}: Redis had lost the prompts stream or its group: made again")
        return records

    async def _start_groups(self, queue: PromptQueue, registry: PolicyRegistry, carried: list) -> None:
        """Submit carried records while there is room: one this worker cannot run is dead-lettered. Never
        start a group under a version older than its `min_version` (the trainer would drop it as stale;
        trainer.feeding rule 4) or more than max_staleness behind the newest; if the newest cannot be
        live now (or the groups in flight must drain first), keep the records and retry (re-reading the
        pointer: a restarted trainer publishes a new address)."""
        while carried and self.version is not None and len(self.inflight) < self._inflight_limit(carried):
            reason = self._refusal(carried[0].group)
            if reason is not None:
                await self._refuse(queue, carried.pop(0), "invalid", reason)
                continue
            latest = await registry.latest()
            if self._too_old_for(carried[0].group, latest):
                live = latest is not None and await self.offer(latest)
                if not live or self._too_old_for(carried[0].group, latest):
                    await queue.keep_alive(carried)  # still ours: no other janitor claims them
                    if not self.inflight:
                        await self.wait_fetch(0.5)
                    break
            if latest is not None:
                self.stats.policy_staleness = latest.version - self.version
            rec = carried.pop(0)
            try:
                self.submit(rec.group, rec)
            except ValueError as e:  # the backend's own fit check (prompt_check should say first)
                await self._refuse(queue, rec, "invalid", why(e))

    def _too_old_for(self, group: PromptGroup, latest: PolicyPointer | None) -> bool:
        """Whether the live version may not start `group`: older than its min_version, or more than
        max_staleness behind the newest."""
        stale = latest is not None and latest.version - self.version > self.max_staleness
        return stale or self.version < group.min_version

    async def _keep_alive(self, queue: PromptQueue, records: list) -> None:
        """Tell Redis these records are still ours, every reclaim_idle_s / 4."""
        if time.monotonic() - self._kept_at >= self.cfg.reclaim_idle_s / 4:
            self._kept_at = time.monotonic()
            await queue.keep_alive(records)

    async def _generate(self, queue: PromptQueue, carried: list) -> list[Finished]:
        """`step`. Non-finite values refuse the live version (`_refuse_live`). If it raises otherwise, the
        batch is dropped (a fresh batcher on the same weights): a group that was alone in it is
        dead-lettered with the error; groups that were in company go back to the front of `carried`, to
        be retried one at a time (`_isolate`)."""
        try:
            return self.step()
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

    async def _commit(self, queue: PromptQueue, finished: list[Finished]) -> None:
        """XADD each finished group's trajectories and XACK its prompt (dead-lettered if scoring raised)."""
        for f in finished:
            if f.error is not None:  # e.g. the task's verifier on fields it did not check
                await self._refuse(queue, f.record, "failed", f"scoring or packing its samples raised {why(f.error)}")
                continue
            n_tokens = sum(len(t.completion_tokens) for t in f.trajectories)
            t1 = time.perf_counter()
            gen_s = t1 - max(f.started, self._committed_at)  # generating time this group adds to the run
            self.stats.generated_tokens_per_second = n_tokens / max(gen_s, 1e-9)
            self._committed_at = t1
            g = self._since_swap
            g[0], g[1], g[2] = g[0] + 1, g[1] + n_tokens, g[2] + gen_s
            await queue.complete(f.record, f.trajectories)
            self.stats.groups += 1
            self.stats.generated_tokens += n_tokens

    def _drained(self) -> bool:
        """No started group is in flight."""
        return self.batcher is None or self.batcher.drained

    # ------------------------------------------------------------------ groups

    def submit(self, group: PromptGroup, record=None) -> None:
        """Hand a prompt group to the batcher (the live version's): n samples, sample i seeded by crc32
        of its sample id. ValueError when the backend cannot fit it."""
        seeds = [zlib.crc32(sample_id_for(group.group_id, i).encode()) for i in range(group.n_samples)]
        self.batcher.submit(
            group.group_id, group.prompt_tokens.tolist(), seeds, max_new_tokens=self.task.max_new_tokens
        )
        self.inflight[group.group_id] = (record, group, time.perf_counter())

    def step(self) -> list[Finished]:
        """One batcher step: the groups it finished, out of `inflight`, scored. Raises what generating
        raised (`run` handles it: `_generate`)."""
        out = []
        with self.tracer.step(), self._decode_stream():
            results = self.batcher.step()
        for result in results:
            rec, group, t0 = self.inflight.pop(result.key)
            self._isolate.discard(group.group_id)
            try:
                out.append(Finished(rec, group, t0, self._trajectories(group, result)))
            except Exception as e:
                out.append(Finished(rec, group, t0, [], e))
        return out

    def _refusal(self, group: PromptGroup) -> str | None:
        """Why this worker cannot run `group` (rollout.prompt_check, with the task's own field check)."""
        return check_prompt(group, self.prompt_rules, check_fields=getattr(self.task, "check_fields", None))

    def _inflight_limit(self, carried: list) -> int:
        """Groups that may be in flight: one while a group that failed in company waits or runs."""
        suspect = self._isolate & ({r.group.group_id for r in carried} | set(self.inflight))
        return 1 if suspect else self.cfg.max_inflight_groups

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
        refused = self.stats.prompts_refused
        before = sum(refused.values())
        refused[kind] = refused.get(kind, 0) + n
        if before < 10 or (before + n) // 1000 > before // 1000:  # a flood is not a log flood
            self.log(f"{self.worker_id}: dead-lettered {what} (#{before + n} refused)")

    def _trajectories(self, group: PromptGroup, result: GroupResult) -> list[Trajectory]:
        n = group.n_samples
        prompt = group.prompt_tokens.tolist()
        now = time.time()
        out = []
        for i, (completion, logps, versions) in enumerate(zip(result.tokens, result.logprobs, result.versions)):
            stale_kv = stale_kv_tokens(versions)
            self.stats.tokens_on_stale_kv += stale_kv
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
                    policy_version=versions[-1],  # the newest; the group started under result.version
                    token_versions=np.asarray(versions, dtype=np.uint32),
                    routed_experts=result.routes[i] if result.routes else None,  # loop.routing_replay
                    contract_fingerprint=self.fingerprint,
                    worker_id=self.worker_id,
                    created_at=now,
                    info={"tokens_on_stale_kv": stale_kv} | ({"ignore_stop": 1} if self.cfg.ignore_stop else {}),
                )
            )
        return out

    # ------------------------------------------------------------------ policy versions (rollout/swap.py)

    async def offer(self, pointer: PolicyPointer) -> bool:
        """Make the newest pointer's version live as soon as it is fetched and no started group is in
        flight (True when it is live now); until then its fetch runs in the background and no group
        starts. In flight (loop.inflight_updates): live as soon as it is fetched, groups starting
        meanwhile. A failure is logged at once and groups start again under the live version."""
        step = self.swap.offer(pointer, now=time.monotonic(), drained=self._drained())
        if step.line:
            self.log(f"{self.worker_id}: {step.line}")
        if step.cancel:
            await self._cancel_fetch()
        if step.action == "fetch":
            self._start_fetch(pointer, step.ticket)
        if step.action in ("fetch", "drain") and self.batcher is not None and not self.swap.inflight:
            self.batcher.request_swap()
        if step.action == "install":
            return await self._install()
        if step.action == "resume" and self.batcher is not None:
            self.batcher.cancel_swap()
        return False

    async def wait_fetch(self, timeout: float) -> None:
        """Sleep up to `timeout` seconds, less if the version being fetched comes in first."""
        job = self._job
        if job is None or job.task.done():
            await asyncio.sleep(timeout if job is None else 0)
        else:
            await asyncio.wait({job.task}, timeout=timeout)

    def _start_fetch(self, pointer: PolicyPointer, ticket: int) -> None:
        cancel = FetchCancel()
        task = asyncio.create_task(asyncio.to_thread(self.fetching.fetch, pointer, cancel))
        task.add_done_callback(
            lambda t: self.swap.fetch_done(ticket, FetchCancelled() if t.cancelled() else t.exception())
        )
        self._job = _FetchJob(cancel, task)

    async def _cancel_fetch(self) -> None:
        """Cancel the fetch in progress (if any) and wait for its thread to let go of the buffers."""
        job, self._job = self._job, None
        if job is not None:
            job.cancel.cancel()
            await asyncio.wait({job.task})

    async def _install(self) -> bool:
        """Swap the fetched version in: copied into the engine (or the CPU model), then the batcher.
        False (logged, counted; groups resume under the live version) when that raised."""
        job, self._job = self._job, None
        fetched, fetched_at, source = job.task.result()
        t0 = time.perf_counter()
        try:
            how = await self._load(fetched)
        except Exception as e:
            line = self.swap.fail(e, now=time.monotonic())  # raises what it does not know
            if line:
                self.log(f"{self.worker_id}: {line}")
            if self.batcher is not None:
                self.batcher.cancel_swap()
            return False
        t1 = time.perf_counter()
        if self.batcher is None:
            self.batcher = ContinuousBatcher(
                self._backend(), max_inflight_groups=self.cfg.max_inflight_groups, version=fetched.version
            )
        else:  # the same backend unless the engine was built anew
            fresh = self._backend() if how == "fresh engine" else None
            continued = self.batcher.backend.live if self.swap.inflight and self.batcher.backend is not None else 0
            self.batcher.swap(fetched.version, fresh, inflight=self.swap.inflight)
            if continued:
                self.stats.inflight_swaps += 1
                how += f", {continued} sample(s) continued in flight"
        previous, pending = self.version, self.swap.went_live()
        t2 = time.perf_counter()
        parts = {
            "receive": fetched.stats.receive_s,
            "verify": fetched.stats.verify_s,
            "drain_wait": max(0.0, t0 - fetched_at),
            "h2d": t1 - t0,
            "swap": t2 - t1,
        }
        self._went_live(pending, fetched, parts, previous, f"{how}, from {source}")
        return True

    async def _load(self, fetched: FetchedPolicy) -> str:
        """Copy a fetched version into the CPU model or the engine, a fresh one for another tensor layout
        (the previous one freed first: nothing is live if building it raises). Returns how."""
        if self.model is not None:
            qat.install_packed(self.model, self.recipe, fetched.tensors, exact=self.loop.exact)
            return "cpu model"
        if self.engine is not None and await asyncio.to_thread(self.engine.update, fetched.tensors):
            return "in place"
        if self.engine is not None:
            self.log(f"{self.worker_id}: v{fetched.version} has another tensor layout: building a fresh engine")
        self.engine = None  # free the previous version's weights, KV cache and graphs first
        if self.batcher is not None and not self.batcher.drained:  # in flight: their KV goes with the engine
            self._requeue += self._give_back()
            self.log(f"{self.worker_id}: {len(self._requeue)} group(s) in flight start again under v{fetched.version}")
        if self.batcher is not None:
            self.batcher.backend = None
        try:
            self.engine = await asyncio.to_thread(self._build_engine, fetched.tensors)
        except BaseException:
            self.swap.unload()  # the old engine is gone: serve nothing until a version loads
            raise
        return "fresh engine"

    def _went_live(self, pending: Pending, fetched: FetchedPolicy, parts: dict, previous, how: str) -> None:
        """Metrics and the "live" line (bench/e2e_report.py reads it) of a version just live."""
        st, pointer, took_s = fetched.stats, pending.pointer, time.monotonic() - pending.seen
        # The pointer's published_at is the trainer's clock: exact on one machine, skewed across hosts.
        after_publish = time.time() - pointer.published_at if pointer.published_at else None  # None: not said
        self.stats.swap_part_seconds = parts
        self.metrics.observe_fetch(st.seconds + parts["h2d"])
        if after_publish is not None:
            self.stats.publish_to_live_seconds = after_publish
        self.health.set_serving(not self.stop.is_set())
        groups, tokens, gen_s = self._since_swap
        self._since_swap = [0, 0, 0.0]
        self.log(
            f"{self.worker_id}: policy v{self.version} live ({st.bytes} bytes, "
            f"{took_s:.2f}s, {'?' if after_publish is None else f'{after_publish:.2f}'}s after publish); "
            f"under v{previous}: {groups} groups, {tokens} tokens in {gen_s:.2f}s generating; "
            + ", ".join(f"{k} {v:.2f}s" for k, v in parts.items())
            + f" ({how}, {self.cfg.fetch_streams} stream(s)"
            + (f", delta against v{st.delta_parent})" if st.delta_parent else ")")
        )

    def _refuse_live(self, e: NonFinite) -> list:
        """The live version computed non-finite values while generating: refused as if at fetch (never
        loaded again), nothing served until a newer one is live. Returns the records of the groups in
        flight, to start again under the next version (their samples so far are dropped)."""
        v = self.swap.refuse_live()
        self.health.set_serving(False)
        records = self._give_back()
        self.log(
            f"{self.worker_id}: v{v} refused while generating: {why(e)}; serving nothing until a newer "
            f"version is live, {len(records)} group(s) kept for it"
        )
        return records

    def _give_back(self) -> list:
        """Drop the groups in flight and the batcher (its scheduler and backend hold their rows: a new
        one at the next swap). Returns their prompt records, to start again."""
        records = [rec for rec, _, _ in self.inflight.values() if rec is not None]
        self.inflight.clear()
        self.batcher = None
        return records

    def _build_engine(self, tensors: dict) -> PackedEngine:
        import torch

        t0 = time.perf_counter()
        engine = PackedEngine(
            self.model_config,
            self.recipe.plan(self.model_config),
            tensors,
            device=self.device,
            engine=EngineConfig(
                max_batch=self.cfg.max_batch,
                max_seq_len=min(self.cfg.kv_capacity, self.model_config.max_seq_len),
                record_routes=self.loop.routing_replay,
            ),
        )
        torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        engine.capture()
        torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        self.log(
            f"{self.worker_id}: fresh engine in {t2 - t0:.1f}s: weights and KV cache {t1 - t0:.1f}s, glue "
            f"compiled and decode graphs captured for {len(engine.ecfg.buckets())} batch sizes {t2 - t1:.1f}s"
        )
        return engine

    def _backend(self):
        """The batcher's backend for the version just loaded: the CPU model or the new PackedEngine."""
        kw = dict(temperature=self.loop.temperature, pad_id=self.task.tokenizer.pad_id)
        eos = self.task.tokenizer.eos_id
        stop = set() if eos is None or self.cfg.ignore_stop else {eos}
        if self.engine is None:
            return ModelBackend(
                self.model, slots=self.cfg.max_batch, stop=stop, record_routes=self.loop.routing_replay, **kw
            )
        return PackedBackend(self.engine, stop=stop, **kw)


def _model(cfg: ModelConfig, device, *, exact: bool) -> Transformer | None:
    """On the CPU, and in exact mode on CUDA (the exact forward is the model's): one model whose
    weights each version overwrites. On CUDA otherwise None: the worker builds a PackedEngine."""
    if device.type != "cpu" and not exact:
        return None
    with device:
        return Transformer(cfg, seed=None)


def _device(cfg: RolloutConfig):
    """rollout.device (ValueError naming the problem when unusable), its memory cap set on CUDA."""
    device = resolve_device(cfg.device)
    if device.type == "cuda" and cfg.memory_fraction:  # processes sharing one GPU (configs/gpu-h200.yaml)
        import torch

        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, device.index or 0)
    return device


def decode_stream(cfg: RolloutConfig, device) -> Callable[[], contextlib.AbstractContextManager]:
    """What a batcher step runs under: with rollout.decode_priority "high" on CUDA, one stream of high
    priority, kept for the worker's life (every step's kernels and host reads on it, in order); else
    the current stream. The engine's other work (building it, copying a version in) ends with a device
    synchronize, so it is ordered with the steps either way."""
    if device.type != "cuda" or cfg.decode_priority != "high":
        return contextlib.nullcontext
    import torch

    stream = torch.cuda.Stream(device, priority=-1)  # -1: high on every torch and GPU
    return lambda: torch.cuda.stream(stream)


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
