"""The trainer service: consume trajectory groups, take GRPO steps under QAT, publish versions.

Each step is a call to a component with one job:
    settle dead-lettered prompts, feed prompts (trainer.feeder) -> collect `groups_per_step`
    admissible groups (trainer.collector) -> GRPO step (trainer.step) -> version += 1 every
    `publish_every` steps, published in the background (trainer.publishing) -> metrics and audit
    lines -> every `checkpoint_every` steps: checkpoint (trainer.checkpoints), then commit the
    samples consumed since the last one (idempotency keys + XACK).
Commit-after-checkpoint means a crash re-delivers exactly the samples whose effect was lost (the
checkpoint lists the samples it includes, and a restart commits them first). A restarted trainer
republishes the checkpoint's version, or, when its weights moved since that publish or the lost
steps published higher versions, a new number above any in Redis: a number never names two policies.
A checkpoint that was not written (a full disk) is retried at the next one while training goes on;
the final one not written exits 1, and a restart resumes from the newest.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from pathlib import Path

from broker.codec import Trajectory
from broker.keys import Keys
from broker.registry import PolicyRegistry
from broker.streams import PromptQueue, StreamConfig, TrajectoryStream, connect
from policy.tracing import StepTracer

from .checkpoints import truncate_jsonl
from .collector import Collector
from .config import TrainerConfig
from .feeder import PromptFeeder
from .ledger import PromptLedger
from .metrics import eta_s, progress_line
from .parts import Parts
from .step import lr_at
from .step_thread import StepThread
from .warmstart import warm_start

# The trainer is the only consumer of the trajectories: its own restarts (not poison: trainer.validation
# refuses that) are what re-deliver entries, so many deliveries are allowed before dead-lettering one.
TRAJECTORY_STREAM = StreamConfig(read_count=256, block_ms=500, max_deliveries=100)


class Trainer:
    """The loop over `parts` (trainer.parts); `run` connects to Redis and makes the components that use
    it (the prompt feeder and the trajectory collector, over one PromptLedger)."""

    def __init__(self, cfg: TrainerConfig, parts: Parts, *, log=print):
        self.cfg, self.parts, self.log = cfg, parts, log
        self.state = parts.state
        self.run_dir = Path(parts.link.run_dir)
        self.ledger = PromptLedger(self.state, parts.task.make_prompt)
        self._stop = asyncio.Event()
        self._weights_version: int | None = None  # the version the weights are (None: moved since its publish)
        self._resumed_from: int | None = None  # the checkpoint step this process resumed from
        self._publish_s = 0.0  # the last publish's seconds on the training thread
        self._step_ends: collections.deque[float] = collections.deque(maxlen=11)  # for the ETA: 10 steps
        self._steps = StepThread(parts.step.device)  # GRPO steps off the event loop (trainer.step_thread)
        self._tracer = StepTracer(cfg.trace, "trainer", parts.step.device, log)  # trainer.trace: off by default

    def request_stop(self) -> None:
        self.parts.health.set_serving(False)
        self._stop.set()

    async def run(self) -> int:
        """Train to `max_steps` or a stop request; 0, or 1 when the final checkpoint was not written."""
        await self._open()
        try:
            if not await self._begin():
                return 0
            while self.state.step < self.cfg.max_steps and not self._stop.is_set():
                t_collect = time.perf_counter()
                await self.feeder.settle_dead_lettered()
                await self.feeder.feed()
                groups = await self.collector.collect(feed=self.feeder.feed, stop=self._stop)
                if groups is None:  # stop requested while collecting
                    break
                row = await self._steps.run(self._train, groups, collect_s=time.perf_counter() - t_collect)
                row.update(await self._publish_if_due())
                self._record(row, groups)
                if not self.cfg.checkpoint_every or self._due(self.cfg.checkpoint_every):
                    await self._checkpoint_and_commit()
                self._step_ends.append(time.monotonic())
                eta = eta_s(self._step_ends, self.cfg.max_steps - self.state.step)
                self.log(progress_line(row, max_steps=self.cfg.max_steps, eta_s=eta))
            return await self._finish()
        finally:
            await self._close()

    # ------------------------------------------------------------------ start and end
    async def _open(self) -> None:
        """Connect to Redis, build the components that use it, start serving."""
        link, cfg, max_staleness = self.parts.link, self.cfg, self.parts.loop.max_staleness
        self.redis = connect(link.redis_url, outage_s=link.redis_outage_s, log=self.log)
        keys = Keys(run_id=link.run_id)
        self.registry = PolicyRegistry(self.redis, keys, signer=link.signer)
        prompts = PromptQueue(self.redis, keys, signer=link.signer)  # signs what it feeds
        stream = TrajectoryStream(self.redis, keys, consumer="trainer", config=TRAJECTORY_STREAM, signer=link.signer)
        self.collector = Collector(
            stream, self.ledger, rules=self.parts.rules, fingerprint=self.parts.contracts.accepted,
            max_staleness=max_staleness, groups_per_step=cfg.groups_per_step, timeout_s=cfg.collect_timeout_s,
            log=self.log,
        )  # fmt: skip
        self.feeder = PromptFeeder(
            self.redis, keys, prompts, stream, self.ledger, self.collector,
            target=cfg.queued_groups(max_staleness), group_size=cfg.group_size, max_staleness=max_staleness,
            on_lost=self.parts.publishing.point_registry, log=self.log,
        )  # fmt: skip
        await prompts.setup()
        await stream.setup()
        self.parts.publishing.start(self.registry)
        self._log_start()

    def _log_start(self) -> None:
        health, metrics, contracts = self.parts.health, self.parts.metrics, self.parts.contracts
        if health.start() is not None:
            self.log(f"health (grpc.health.v1) on {health.host}:{health.port}")
        self.log(
            f"policy server on {self.parts.publishing.server.address}; metrics in {metrics.path}"
            + (f" and on Prometheus port {metrics.port}" if metrics.port else "")
        )
        if contracts.breaking:
            self.log(
                f"contract-breaking ablation (rollout_recipe): training under {contracts.recipe.name}, publishing "
                f"and accepting {contracts.rollout_recipe.name} (fingerprint {contracts.accepted[:12]})"
            )

    async def _begin(self) -> bool:
        """Resume or warm-start, adopt what Redis holds, publish; False: stopped during the warm start."""
        found = self.parts.checkpointer.load_latest(self.parts.contracts.fingerprint)
        await (self._restore(*found) if found is not None else self._warm_start())
        if self._stop.is_set() and not self.state.version:
            self.log("stopped during the warm start: nothing saved, a restart warms up again")
            return False
        await self.feeder.reconcile()
        t_publish = time.perf_counter()
        await self._publish()
        self._publish_s = time.perf_counter() - t_publish
        return True

    async def _finish(self) -> int:
        """The last version announced (or its failure raised), the last steps checkpointed and committed."""
        await self.parts.publishing.idle()
        if (self.cfg.checkpoint_every and self.state.step > self.parts.checkpointer.newest_step) or (
            self.state.pending_commit
        ):
            if not await self._checkpoint_and_commit():
                return self._exit_unsaved()
        if self._stop.is_set():
            newest = self.parts.checkpointer.newest_step
            where = f"checkpoint step-{newest:06d}.pt" if self.cfg.checkpoint_every else "no checkpoints"
            self.log(f"stopped at step {self.state.step} ({where})")
        return 0

    async def _close(self) -> None:
        self._steps.close()
        await self.parts.publishing.close()  # its thread writes into our buffers and server
        self.parts.health.stop()
        self.parts.metrics.close()
        await self.redis.aclose()

    def _exit_unsaved(self) -> int:
        """The final checkpoint was not written: one line, exit code 1 (restart me). Nothing since the
        newest checkpoint was committed, so a restart trains those steps again from their samples."""
        newest = self.parts.checkpointer.newest_step
        since = "no checkpoint was written" if newest < 0 else f"the newest checkpoint is step {newest}"
        self.log(
            f"exiting 1: the final checkpoint (step {self.state.step}) was not written; {since}, a restart resumes there"
        )
        return 1

    # ------------------------------------------------------------------ one step
    def _due(self, every: int) -> bool:
        """Whether something done every `every` steps is due after this step (always after the last)."""
        return self.state.step % every == 0 or self.state.step == self.cfg.max_steps

    def _train(self, groups: list[list[Trajectory]], *, collect_s: float) -> dict:
        """The GRPO step on `groups`, the State moved past it; the step's metrics row."""
        parts, state = self.parts, self.state
        lr = lr_at(self.cfg, state.step)
        parts.backend.set_lr(lr)
        with self._tracer.step():
            row = parts.step.optimize(
                parts.step.recompute(groups, weights_version=self._weights_version), version=state.version
            )
        row.update(
            dropped_stale=state.dropped_stale,
            dropped_fingerprint=state.dropped_fingerprint,
            **self.collector.counters(),
            rollout_recipe=parts.contracts.rollout_recipe.name,
            contract_breaking=parts.contracts.breaking,
            lr=lr,
            collect_s=collect_s,
            publish_s=self._publish_s,
            quantize_s=parts.publishing.quantize_s,
            policy_sent_bytes=parts.publishing.sent_bytes,  # the trainer's egress so far, as of the last publish
            relays=parts.publishing.relays_named,
        )
        if any(t.info.get("ignore_stop") for g in groups for t in g):
            row["benchmark_ignore_stop"] = 1  # rollout.ignore_stop: completions did not end at their stop token
        state.step += 1
        state.samples += row["samples"]
        state.completion_tokens += row["completion_tokens"]
        publish = self._due(self.cfg.publish_every)
        state.version += publish
        self._weights_version = state.version if publish else None
        row.update(step=state.step, policy_version=state.version, time=time.time())
        if self.cfg.eval_every and state.step % self.cfg.eval_every == 0:
            row.update(self._evaluate())
        return row

    def _evaluate(self) -> dict:
        """Held-out accuracy of the current weights, and the seconds it took (`eval_s`)."""
        t0 = time.perf_counter()
        with self.parts.step.autocast:
            out = dict(self.parts.task.evaluate(self.parts.backend.model))
        return {**out, "eval_s": time.perf_counter() - t0}

    async def _publish_if_due(self) -> dict:
        """Publish the step's version if one is due: the row's publish_blocked_s (what the step waited
        for the previous publish), publish_bg_s (the previous publish's background seconds) and
        publish_announce_wait_s (how long that version, once servable, waited to be announced)."""
        if not self._due(self.cfg.publish_every):
            return {"publish_blocked_s": 0.0}
        t_publish = time.perf_counter()
        blocked = await self._publish()
        if self.parts.loop.max_staleness == 0:
            # The synchronous loop: every sample of the next step must come from this version, so no
            # prompt is fed before the workers can fetch it.
            await self.parts.publishing.idle()
        self._publish_s = time.perf_counter() - t_publish
        publishing = self.parts.publishing
        return {
            "publish_blocked_s": blocked,
            "publish_bg_s": publishing.background_s,
            "publish_announce_wait_s": publishing.publisher.announce_wait_s,
        }

    async def _publish(self) -> float:
        """Start publishing the current version (it is safe before the checkpoint: a restart from an
        older one numbers its weights above any version announced since)."""
        return await self.parts.publishing.publish(self.state.version, announced=self._announced)

    def _announced(self) -> None:
        self.state.versions_published += 1
        self.parts.health.set_serving(not self._stop.is_set())

    def _record(self, row: dict, groups: list[list[Trajectory]]) -> None:
        """The metrics row and the audit line of the step (written before the checkpoint: a restart
        truncates the lines past the checkpoint's step)."""
        versions = self.parts.step.versions
        row.update(
            retained_versions=len(versions.versions()),
            retained_bytes=versions.nbytes(),
            outstanding_groups=len(self.state.outstanding),  # fed, not yet used or dropped: the backlog
        )
        if self._resumed_from is not None:  # the plots mark where the run resumed
            row["resumed_from"], self._resumed_from = self._resumed_from, None
        self.parts.metrics.write(row)
        line = {
            "step": self.state.step,
            "version": self.state.version,
            # [group id, newest version, worker, the oldest token's version of the group]
            "groups": [
                [g[0].group_id, max(t.policy_version for t in g), g[0].worker_id, min(t.oldest_version for t in g)]
                for g in groups
            ],
            "dropped": self.state.dropped_unaudited,
        }
        self.state.dropped_unaudited = []
        with open(self.run_dir / "audit.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # ------------------------------------------------------------------ checkpoints
    async def _checkpoint_and_commit(self) -> bool:
        """Checkpoint, then commit what it includes; False (nothing committed) if it was not written.
        checkpoint_every 0 (never): commit alone (no resume)."""
        if self.cfg.checkpoint_every and not self._save_checkpoint():
            return False
        await self.collector.commit()
        return True

    def _save_checkpoint(self) -> bool:
        """The retained versions (trainer.versions) are not saved: after a restart, samples of older
        versions are left out of the quantization/staleness split until they are gone."""
        content = {
            **self.parts.backend.state_dict(),  # model (canonical names), optimizer, backend
            "state": vars(self.state),
            "fingerprint": self.parts.contracts.fingerprint,
            "weights_version": self._weights_version,
        }
        return self.parts.checkpointer.save(self.state.step, content)

    async def _restore(self, path: Path, ck: dict) -> None:
        self.parts.backend.load_state_dict(ck)
        self.state.restore(ck["state"])
        await self.collector.commit()  # the checkpoint includes these samples: used, before anything is read
        for name in ("metrics.jsonl", "audit.jsonl"):  # the steps after the checkpoint are redone
            truncate_jsonl(self.run_dir / name, self.state.step)
        # The restored weights are the checkpoint's version, unless steps since the last publish
        # moved them; they get a new number then, or when lost steps published higher numbers.
        latest = await self.registry.latest()
        moved = ck.get("weights_version", self.state.version) != self.state.version
        if moved or (latest is not None and latest.version > self.state.version):
            self.state.version = max(self.state.version, latest.version if latest else 0) + 1
        self._resumed_from = self.state.step
        self._weights_version = self.state.version
        self.log(f"resumed from {path}: step {self.state.step}, version {self.state.version}")

    async def _warm_start(self) -> None:
        """Initial weights, then `warmstart_steps` supervised steps (on the step thread, so that the event
        loop takes a stop request between them), version 1 checkpointed, QAT installed."""
        backend, task, cfg = self.parts.backend, self.parts.task, self.cfg
        t0 = time.perf_counter()
        if task.init_weights is not None:
            backend.init_weights(task.init_weights)
            self.log(f"initial weights loaded ({time.perf_counter() - t0:.1f}s)")
        if cfg.warmstart_steps:
            until = (lambda: task.warmstart_score(backend.model)) if cfg.warmstart_until else None
            await self._steps.run(
                warm_start, backend, task.warm_start_example, steps=cfg.warmstart_steps, batch=cfg.warmstart_batch,
                lr=cfg.warmstart_lr, pad_id=task.pad_id, stop=self._stop.is_set, until=until,
                target=cfg.warmstart_until, log=self.log,
            )  # fmt: skip
            if self._stop.is_set():
                return  # stopped: nothing saved, a restart warms up again
        self.state.version = self._weights_version = 1
        if cfg.checkpoint_every:
            self._save_checkpoint()
        backend.apply_qat()
