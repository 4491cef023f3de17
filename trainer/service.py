"""The trainer service: consume trajectory groups, take GRPO steps under QAT, publish versions.

One step, as a short loop (slime-style):
    feed prompts -> collect `groups_per_step` admissible groups -> GRPO step(s) -> version += 1
    -> every `checkpoint_every` steps: checkpoint, then commit the samples consumed since the last
       one (idempotency keys + XACK) -> publish (in the background: trainer.publisher)
Commit-after-checkpoint means a crash re-delivers exactly the samples whose effect was lost (the
checkpoint lists the samples it includes, and a restart commits them first). A restarted trainer
republishes the checkpoint's version, or, when its weights moved since that publish or the lost
steps published higher versions, a new number above any in Redis: a number never names two policies.

A checkpoint (checkpoints/step-NNNNNN.pt, the newest `keep_checkpoints` kept) holds the fp32
master weights, the AdamW state (two more tensors per parameter), the State below and the contract
fingerprint: about 3x the model's fp32 size. It is written to a temporary file, fsynced and
renamed (trainer.atomic), so a crash leaves the previous checkpoint whole; a write that fails (a full
disk) leaves it whole too, is logged and retried at the next checkpoint while training goes on.

The trainer is task-agnostic: the prompts it feeds and the warm-start examples come from
callables the `tandem trainer` command builds from the configured task.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from broker import frames
from broker.codec import CodecError, PromptGroup, Trajectory, decode_prompt_group
from broker.health import TRAINER_HEALTH, HealthServer
from broker.keys import Keys
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import PolicyPointer, PolicyRegistry
from broker.server_process import PolicyServerProcess
from broker.signing import Signer, policy_token
from broker.streams import (
    DATA_FIELD,
    DeadLetter,
    PromptQueue,
    StreamConfig,
    TrajectoryRecord,
    TrajectoryStream,
    connect,
    read_deadletter,
)
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.loop import AsyncConfig
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe

from . import admission, feeding, grpo
from .atomic import stale_temporaries, write_atomically
from .backends import make_backend
from .config import TrainerConfig
from .metrics import MetricsSink, MetricWriter, eta_s, format_duration
from .publisher import Publisher
from .sequences import pack, scatter_rows
from .validation import TrajectoryRules, check_trajectory
from .versions import RetainedVersions, aliasing
from .warmstart import lr_factor, warm_start

# Test hook of tests/faults: TANDEM_FAULT_POINT=<name>@<step> SIGKILLs the trainer at that point of
# that step (read once, at import). Points: "mid_checkpoint" (the checkpoint's temporary file
# written, not yet renamed), "before_commit" (the checkpoint durable, the samples not yet committed).
_FAULT_POINT = os.environ.get("TANDEM_FAULT_POINT", "")


def fault_point(name: str, step: int) -> None:
    if _FAULT_POINT == f"{name}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class State:
    """What a checkpoint holds besides model and optimizer."""

    step: int = 0
    version: int = 0
    # Cumulative counters (exported to Prometheus as tandem_trainer_<name>_total; a restart
    # continues from the checkpoint's totals).
    samples: int = 0
    completion_tokens: int = 0
    versions_published: int = 0
    dropped_stale: int = 0
    dropped_fingerprint: int = 0
    # (stream_id, sample_id) of every sample consumed since the previous checkpoint
    pending_commit: list = field(default_factory=list)
    # Exactly-once without trusting Redis: the next prompt index to feed, and every group fed and
    # not yet used or dropped (group_id -> prompt index). A sample of any other group is refused,
    # and after Redis lost the queue (trainer.feeding rule 1) these are fed again.
    prompt_seq: int = 0
    outstanding: dict = field(default_factory=dict)
    # Groups settled without training since the last audit line: listed in the next one, also when
    # that line is written after a stop and resume (a stop mid-collect writes no audit line).
    dropped_unaudited: list = field(default_factory=list)
    # Totals over the whole run (persisted: a restart does not reset them).
    invalid: int = 0  # samples refused by trainer.validation, dead-lettered with the reason
    malformed: int = 0  # undecodable trajectory entries, dead-lettered
    duplicates: int = 0  # samples already used or already held, acked and dropped
    dead_lettered: int = 0  # entries dead-lettered after more than max_deliveries deliveries
    refed: int = 0  # prompts fed again after Redis lost them
    unsigned: int = 0  # trajectory entries without a valid run-secret signature, dead-lettered
    prompts_dead_lettered: int = 0  # fed prompt groups the workers dead-lettered, settled as dropped


@dataclass
class Batch:
    """One step's samples packed into rows [B, T] (see trainer.sequences.pack), with the step's
    per-sample data and the trainer's recomputed log-probs."""

    tokens: torch.Tensor
    targets: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor  # completion tokens
    behav: torch.Tensor  # the rollouts' behavior log-probs
    rewards: torch.Tensor  # [B]
    adv: torch.Tensor  # [B] group-normalized advantages
    versions: torch.Tensor  # [B] policy version each sample came from
    prox: torch.Tensor  # current weights (proximal policy)
    at_version: torch.Tensor  # each sample's own version
    started: float  # perf_counter at the start of the step
    known: torch.Tensor | None = None  # [B] bool: rows whose version's weights are held (at_version valid)
    recompute_s: float = 0.0  # seconds the recompute took (older versions' forwards included)
    at_version_s: float = 0.0  # of which the older versions' forwards (trainer.versions)


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        run_id: str,
        redis_url: str,
        model_config: ModelConfig,
        recipe: Recipe,
        rollout_recipe: Recipe | None = None,
        loop: AsyncConfig,
        redis_outage_s: float = 60.0,
        signer: Signer | None = None,
        run_dir: str | Path,
        make_prompt: Callable[[int], PromptGroup],
        warm_start_example: Callable[[], tuple[list[int], list[int]]],
        pad_id: int,
        max_completion_tokens: int = 64,
        init_weights: Callable[[Transformer], None] | None = None,
        evaluate: Callable[[Transformer], dict] | None = None,
        writers: Sequence[MetricWriter] = (),
        log: Callable[[str], None] = print,
    ):
        """evaluate: the held-out evaluation run every `eval_every` steps on the current model (its
        numbers join the step's metrics row); writers: fed every metrics row (trainer.metrics)."""
        self.cfg, self.loop, self.log = cfg, loop, log
        self.max_staleness = loop.max_staleness
        self.temperature = loop.temperature  # the rollouts' sampling temperature: log-probs must match it
        seed = loop.seed
        self.keys = Keys(run_id=run_id)
        self.redis_url, self.redis_outage_s, self.signer = redis_url, redis_outage_s, signer
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self._ckpt_step = -1  # the step of the newest checkpoint on disk
        self._weights_version: int | None = None  # the version the model's weights are (None: moved since)
        self._resumed_from: int | None = None  # the checkpoint step this process resumed from
        self.make_prompt, self.warm_start_example, self.pad_id = make_prompt, warm_start_example, pad_id
        self.evaluate = evaluate
        if cfg.eval_every and evaluate is None:
            raise ValueError(f"trainer.eval_every={cfg.eval_every} but the trainer was given no evaluation")
        self._step_ends: collections.deque[float] = collections.deque(maxlen=11)  # for the ETA: 10 steps
        self.init_weights = init_weights  # e.g. a Hugging Face checkpoint; used when no checkpoint of ours exists
        torch.manual_seed(seed)
        self.model_config, self.recipe = model_config, recipe
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("trainer.device='cuda' but torch sees no CUDA device")
        if self.device.type == "cuda":
            # Before CUDA's allocator starts (it reads this once): the step's allocations change size with
            # every batch, and without expandable segments the e2e run's trainer died at its memory cap with
            # 12 GB reserved but unusable (docs/benchmarks.md). A user's own setting wins.
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            if cfg.mps_thread_percentage:  # read when the CUDA context is created (the first kernel)
                os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cfg.mps_thread_percentage)
        if self.device.type == "cuda" and cfg.memory_fraction:  # processes sharing one GPU (configs/gpu-h200.yaml)
            torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, self.device.index or 0)
        # The model, its optimizer and QAT (trainer/backends.py): fp32 master weights and AdamW state,
        # bf16 autocast on CUDA (the effective operands of every quantized format are exact in bf16,
        # DESIGN.md "Compute contract").
        self.backend = make_backend(cfg, model_config, recipe, seed=seed)
        self.autocast = self.backend.autocast()
        self.contract = contract_from_recipe(model_config=model_config, recipe=recipe)
        self.fingerprint = self.contract.fingerprint()
        # The rollout_recipe ablation knob (None = `recipe`): publish under the rollouts' recipe and accept
        # its fingerprint, breaking the contract on purpose. Without the knob both are the training ones.
        self.rollout_recipe = rollout_recipe or recipe
        self.publish_plan = self.rollout_recipe.plan(model_config)
        self.publish_contract = contract_from_recipe(model_config=model_config, recipe=self.rollout_recipe)
        self.accepted_fingerprint = self.publish_contract.fingerprint()
        self.contract_breaking = self.accepted_fingerprint != self.fingerprint
        self.rules = TrajectoryRules(
            group_size=cfg.group_size,
            vocab_size=model_config.vocab_size,
            max_seq_len=model_config.max_seq_len,
            max_completion_tokens=max_completion_tokens,
            max_abs_reward=cfg.max_abs_reward,
        )
        self._fed_tokens: dict[str, np.ndarray] = {}  # group_id -> prompt tokens, of outstanding groups
        self._settled_recent: dict[str, None] = {}  # recently settled group ids (insertion-ordered, capped)
        self.state = State()
        # The newest versions' packed tensors as their publish produced them, for the mismatch split's
        # log-probs under each sample's own version (trainer.versions: no fp32 copy, no re-quantization).
        self.versions = RetainedVersions(model_config, recipe.plan(model_config), keep=self.max_staleness)
        server_config = PolicyServerConfig(
            host=cfg.grpc_host,
            port=cfg.grpc_port,
            keep_versions=self.max_staleness + 2,
            reflection=cfg.grpc_reflection,
            tls=cfg.tls,
            fetch_deadline_s=cfg.fetch_deadline_s,
            stall_s=cfg.stall_s,
            run_token=policy_token(self.signer),
            serve_unauthenticated=cfg.serve_unauthenticated,
            max_unauthenticated_streams=cfg.max_unauthenticated_streams,
            max_streams_per_peer=cfg.max_streams_per_peer,
        )
        cuda = self.device.type == "cuda"
        in_child = cuda if cfg.policy_server_process is None else cfg.policy_server_process
        self.server = PolicyServerProcess(server_config, log=self.log) if in_child else PolicyServer(server_config)
        # Versions are framed into reusable page-locked host buffers (shared memory that the server's
        # process maps, when it has one) and published off the step.
        self.buffers = frames.BufferPool(pin=cuda, shared=in_child)
        self._digests: dict[int, str] = {}  # version -> its manifest's digest (hex), named in policy:latest
        self.publisher = Publisher(log=self.log)
        self.health = HealthServer(
            port=cfg.health.port, service=TRAINER_HEALTH, host=cfg.health.host
        )  # Kubernetes probes
        self.metrics = MetricsSink(
            self.run_dir / "metrics.jsonl",
            port=cfg.metrics_port,
            host=cfg.metrics_host,
            state=lambda: vars(self.state),
            writers=writers,
        )
        if self.metrics.endpoint is not None:
            self.metrics.endpoint.add_callback(self.server.prometheus_samples)
        self._stop = asyncio.Event()
        self._backlog = admission.Backlog()  # incomplete groups and surplus complete ones, between steps
        # Refused samples (wrong fingerprint, invalid) with the reason: dead-lettered at the next commit.
        self._rejected: list[tuple[TrajectoryRecord, str]] = []
        self._consumed: list[TrajectoryRecord] = []  # consumed by the _collect in progress
        self._deadletter_from = "-"  # the dead-letter stream is read from here (_settle_dead_lettered)
        # This incarnation's mark in Redis (trainer.feeding rule 1), and the stream ids read before Redis
        # last lost its data (no longer in Redis: not subtracted from its count of queued samples).
        self._nonce = secrets.token_hex(16)
        self._lost_ids: set[str] = set()
        # The last publish on the training thread: its seconds, and of them producing the quantized parts
        # (metrics); the background part of the last publish that finished (set by its thread).
        self._publish_s = self._quantize_s = self._publish_bg_s = 0.0

    # ------------------------------------------------------------------ lifecycle
    def request_stop(self) -> None:
        self.health.set_serving(False)
        self._stop.set()

    async def run(self) -> int:
        self.redis = connect(self.redis_url, outage_s=self.redis_outage_s, log=self.log)
        self.registry = PolicyRegistry(self.redis, self.keys, signer=self.signer)
        self.prompts = PromptQueue(self.redis, self.keys, signer=self.signer)  # signs what it feeds
        self.stream = TrajectoryStream(
            self.redis,
            self.keys,
            consumer="trainer",
            # The trainer is the only consumer: its own restarts (not poison: trainer.validation refuses
            # that) are what re-deliver entries, so allow many before dead-lettering an innocent sample.
            config=StreamConfig(read_count=256, block_ms=500, max_deliveries=100),
            signer=self.signer,
        )
        await self.prompts.setup()
        await self.stream.setup()
        self.server.start()
        if self.health.start() is not None:
            self.log(f"health (grpc.health.v1) on {self.health.host}:{self.health.port}")
        self.log(
            f"policy server on {self.server.address}; metrics in {self.metrics.path}"
            + (f" and on Prometheus port {self.metrics.port}" if self.metrics.port else "")
        )
        if self.contract_breaking:
            self.log(
                f"contract-breaking ablation (rollout_recipe): training under {self.recipe.name}, publishing and "
                f"accepting {self.rollout_recipe.name} (fingerprint {self.accepted_fingerprint[:12]})"
            )
        try:
            await self._restore_or_warm_start()
            if self._stop.is_set() and not self.state.version:
                self.log("stopped during the warm start: nothing saved, a restart warms up again")
                return 0
            await self._reconcile_prompts()
            t_publish = time.perf_counter()
            await self._publish()
            self._publish_s = time.perf_counter() - t_publish
            while self.state.step < self.cfg.max_steps and not self._stop.is_set():
                t_collect = time.perf_counter()
                await self._settle_dead_lettered()
                await self._feed_prompts()
                groups, records = await self._collect()
                if groups is None:  # stop requested while collecting: what it dropped is consumed
                    self.state.pending_commit += [(r.stream_id, r.trajectory.sample_id) for r in self._consumed]
                    break
                collect_s = time.perf_counter() - t_collect
                lr = self._lr()
                self.backend.set_lr(lr)
                row = self.optimize(self.recompute_logprobs(groups))
                row.update(
                    lr=lr,
                    collect_s=collect_s,
                    publish_s=self._publish_s,
                    quantize_s=self._quantize_s,
                )
                self.state.step += 1
                self.state.samples += row["samples"]
                self.state.completion_tokens += row["completion_tokens"]
                self.state.pending_commit += [(r.stream_id, r.trajectory.sample_id) for r in records]
                last = self.state.step == self.cfg.max_steps
                publish = self.state.step % self.cfg.publish_every == 0 or last
                self.state.version += publish
                self._weights_version = self.state.version if publish else None
                row.update(step=self.state.step, policy_version=self.state.version, time=time.time())
                if self.cfg.eval_every and self.state.step % self.cfg.eval_every == 0:
                    row.update(self._evaluate())
                # Publishing runs off the step (trainer.publisher); what the step still waits for is logged.
                # Starting it before the checkpoint is safe: a restart from an older checkpoint numbers its
                # weights above any version announced since (see _restore_or_warm_start).
                row["publish_blocked_s"] = 0.0
                if publish:
                    t_publish = time.perf_counter()
                    row["publish_blocked_s"] = await self._publish()
                    if self.max_staleness == 0:
                        # Synchronous: every sample of the next step must come from this version, so feed
                        # no prompt before workers can see it. Feeding while it was still being framed let
                        # workers generate groups under the old one, all dropped as stale (3,880 samples in
                        # 12 steps of the H200 run).
                        await self.publisher.idle()
                    self._publish_s = time.perf_counter() - t_publish
                    row["publish_bg_s"] = self._publish_bg_s  # the previous publish's (awaited just now)
                row.update(
                    retained_versions=len(self.versions.versions()),
                    retained_bytes=self.versions.nbytes(),
                    outstanding_groups=len(self.state.outstanding),  # fed, not yet used or dropped: the backlog
                )
                if self._resumed_from is not None:  # the plots mark where the run resumed
                    row["resumed_from"], self._resumed_from = self._resumed_from, None
                # Written before the checkpoint: a restart truncates lines past the checkpoint's step.
                self.metrics.write(row)
                self._audit(groups)
                if not self.cfg.checkpoint_every or self.state.step % self.cfg.checkpoint_every == 0 or last:
                    await self._checkpoint_and_commit()
                self.log(self._progress_line(row))
            await self.publisher.idle()  # the last version announced (or its failure raised)
            if (self.cfg.checkpoint_every and self.state.step > self._ckpt_step) or self.state.pending_commit:
                if not await self._checkpoint_and_commit():  # keep what was done
                    return self._exit_unsaved()
            if self._stop.is_set():
                where = f"checkpoint step-{self._ckpt_step:06d}.pt" if self.cfg.checkpoint_every else "no checkpoints"
                self.log(f"stopped at step {self.state.step} ({where})")
            return 0
        finally:
            await self.publisher.settle()  # its thread writes into our buffers and server
            self.health.stop()
            self.server.stop()
            self.buffers.close()
            self.metrics.close()
            await self.redis.aclose()

    def _lr(self) -> float:
        """The learning rate of the step about to be taken: a function of State.step alone (resumes exactly)."""
        s = self.cfg.lr_schedule
        t = self.state.step
        return self.cfg.lr * lr_factor(
            t, steps=self.cfg.max_steps, warmup=s.warmup_steps, kind=s.kind, min_ratio=s.min_lr_ratio
        )

    def _evaluate(self) -> dict:
        """Held-out accuracy of the current weights, and the seconds it took (`eval_s`)."""
        t0 = time.perf_counter()
        with self.autocast:
            out = dict(self.evaluate(self.backend.model))
        return {**out, "eval_s": time.perf_counter() - t0}

    def _progress_line(self, r: dict) -> str:
        """One line per step; a mismatch part over no known sample (all from before a restart) reads n/a.
        The ETA is the mean wall time of the last 10 steps times the steps left (trainer.metrics.eta_s)."""
        self._step_ends.append(time.monotonic())
        eta = format_duration(eta_s(self._step_ends, self.cfg.max_steps - r["step"]))
        quant, stale = r.get("logp_abs_diff_quant"), r.get("logp_abs_diff_stale")
        split = "n/a" if quant is None else f"{quant:.1e} stale {stale:.4f}"
        evals = (
            f" eval greedy {r['eval_greedy_accuracy']:.3f} sampled {r['eval_sampled_accuracy']:.3f}"
            if "eval_greedy_accuracy" in r
            else ""
        )
        return (
            f"step {r['step']:>4}/{self.cfg.max_steps} v{r['policy_version']} reward {r['reward_mean']:.3f} "
            f"staleness {r['staleness_mean']:.2f}/{r['staleness_max']} dropped {r['dropped_stale']}s/"
            f"{r['dropped_fingerprint']}f |dlogp| {r['logp_abs_diff']:.4f} (quant {split}"
            f") kl {r['kl_k3']:.5f} lr {r['lr']:.2e} {r['step_time_s']:.2f}s{evals} eta {eta}"
        )

    async def _checkpoint_and_commit(self) -> bool:
        """Checkpoint, then commit what it includes; False (nothing committed) if it was not written."""
        if self.cfg.checkpoint_every and not self._save_checkpoint():  # 0 = never: commit alone (no resume)
            return False
        fault_point("before_commit", self.state.step)
        await self._commit()
        return True

    def _exit_unsaved(self) -> int:
        """The final checkpoint was not written: one line, exit code 1 (restart me). Nothing since the
        newest checkpoint was committed, so a restart trains those steps again from their samples."""
        since = (
            "no checkpoint was written" if self._ckpt_step < 0 else f"the newest checkpoint is step {self._ckpt_step}"
        )
        self.log(
            f"exiting 1: the final checkpoint (step {self.state.step}) was not written; {since}, a restart resumes there"
        )
        return 1

    async def _commit(self) -> None:
        """After a checkpoint: dead-letter the refused samples, mark every consumed sample used."""
        for rec, reason in self._rejected:
            await self.stream.dead_letter(rec, reason)
        self._rejected = []
        await self.stream.commit_ids(self.state.pending_commit)
        self.state.pending_commit = []

    # ------------------------------------------------------------------ checkpoint / warm start
    async def _restore_or_warm_start(self) -> None:
        for tmp in stale_temporaries(self.ckpt_dir):  # a write cut short by a crash
            tmp.unlink(missing_ok=True)
        path = latest_checkpoint(self.ckpt_dir)
        if path is not None:
            ck = torch.load(path, map_location="cpu", weights_only=True)
            if ck["fingerprint"] != self.fingerprint:
                raise ValueError(
                    f"checkpoint {path} has contract fingerprint {ck['fingerprint'][:12]}, "
                    f"this run's is {self.fingerprint[:12]}: different model/recipe"
                )
            self.backend.load_state_dict(ck)
            self.state = State(**{**vars(State()), **ck["state"]})  # fields added since: their defaults
            # The checkpoint includes these samples: mark them used before reading anything.
            await self.stream.commit_ids([tuple(p) for p in self.state.pending_commit])
            self.state.pending_commit = []
            # Steps after the checkpoint are redone: forget their lines.
            for name in ("metrics.jsonl", "audit.jsonl"):
                _truncate_jsonl(self.run_dir / name, self.state.step)
            # The restored weights are the checkpoint's version, unless steps since the last publish
            # moved them; they get a new number then, or when lost steps published higher numbers.
            latest = await self.registry.latest()
            moved = ck.get("weights_version", self.state.version) != self.state.version
            if moved or (latest is not None and latest.version > self.state.version):
                self.state.version = max(self.state.version, latest.version if latest else 0) + 1
            self._ckpt_step = self._resumed_from = self.state.step
            self._weights_version = self.state.version
            self.log(f"resumed from {path}: step {self.state.step}, version {self.state.version}")
            return
        t0 = time.perf_counter()
        if self.init_weights is not None:
            self.backend.init_weights(self.init_weights)
            self.log(f"initial weights loaded ({time.perf_counter() - t0:.1f}s)")
        if self.cfg.warmstart_steps:
            # On a thread, so that the event loop takes a stop request (a signal) between its steps.
            losses = await asyncio.to_thread(
                warm_start,
                self.backend,
                self.warm_start_example,
                steps=self.cfg.warmstart_steps,
                batch=self.cfg.warmstart_batch,
                lr=self.cfg.warmstart_lr,
                pad_id=self.pad_id,
                stop=self._stop.is_set,
                log=self.log,
            )
            if len(losses) < self.cfg.warmstart_steps:
                return  # stopped: nothing saved, a restart warms up again
        self.state.version = self._weights_version = 1
        if self.cfg.checkpoint_every:
            self._save_checkpoint()
        self.backend.apply_qat()

    def _audit(self, groups: list[list[Trajectory]]) -> None:
        """audit.jsonl: which groups each step used, from which version and worker (one line per step)."""
        line = {
            "step": self.state.step,
            "version": self.state.version,
            "groups": [[g[0].group_id, g[0].policy_version, g[0].worker_id] for g in groups],
            "dropped": self.state.dropped_unaudited,
        }
        self.state.dropped_unaudited = []
        with open(self.run_dir / "audit.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def _save_checkpoint(self) -> bool:
        """checkpoints/step-NNNNNN.pt, atomically (trainer.atomic); then only the newest
        `keep_checkpoints` are kept. A write that fails (a full disk: any OSError) leaves no temporary
        file and the previous checkpoint the newest: one line, False, and training goes on (the next
        checkpoint retries; the samples since the last one stay uncommitted until one is written).
        The retained versions used for the mismatch metrics (trainer.versions) are not saved: after a
        restart, samples of older versions are left out of the quantization/staleness split until
        they are gone."""
        path = self.ckpt_dir / f"step-{self.state.step:06d}.pt"
        ck = {
            **self.backend.state_dict(),  # model (canonical names), optimizer, backend
            "state": vars(self.state),
            "fingerprint": self.fingerprint,
            "weights_version": self._weights_version,
        }
        try:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(
                path, functools.partial(torch.save, ck), lambda: fault_point("mid_checkpoint", self.state.step)
            )
        except OSError as e:
            newest = latest_checkpoint(self.ckpt_dir)
            self.log(
                f"checkpoint {path.name} not written ({e.strerror or e}); training on, the newest checkpoint is "
                f"{newest.name if newest else 'none'}; the next checkpoint tries again"
            )
            return False
        self._ckpt_step = self.state.step
        for old in checkpoints(self.ckpt_dir)[: -self.cfg.keep_checkpoints]:
            old.unlink()
        return True

    # ------------------------------------------------------------------ publish / feed
    async def _publish(self) -> float:
        """Start publishing the current version (trainer.publisher) and retain its packed tensors
        (trainer.versions). On the training thread: wait for the previous publish (back-pressure;
        returned, `publish_blocked_s`), queue the NaN/Inf check of the master weights, produce the
        quantized parts (the QAT cache refill, which the next forward needs anyway: `quantize_s`,
        host time, its GPU work runs on behind it). Nothing here waits for the GPU. In the publisher's
        thread (`publish_bg_s`): the check's result (a failure is raised by the next publish, the
        version is never served), describing the parts (their global scales are read there: the
        first wait for the refill's GPU work), framing, hashing and installing in the server; then
        policy:latest names the version, once it is servable. Parts sharing storage with a live
        parameter (none with fp32 master weights) are staged here instead, before the next update."""
        blocked = await self.publisher.idle()  # at most one publish in flight; raises if the previous one failed
        if self.backend.qat_hook is None:
            self.backend.apply_qat()
        v = self.state.version
        t0 = time.perf_counter()
        check = self.backend.finite_check()  # queued on the device; read in the thread
        retained = self.backend.quantized_params(check_finite=False)  # the QAT forward's own quantized parts
        if self.contract_breaking:  # the rollout_recipe ablation: published as the rollouts' recipe says
            tensors = quantize_params(self.backend.canonical(), self.publish_plan)
        else:
            tensors = retained
        self._quantize_s = time.perf_counter() - t0
        live = list(self.backend.parameters())
        self.versions.add(v, retained, live=live)
        stage = functools.partial(
            frames.stage,
            version=v,
            parent_version=v - 1 if v > 1 else None,
            contract=self.publish_contract,
            tensors=tensors,
            pool=self.buffers,
        )
        staged = stage(live=live) if aliasing(tensors, live) else None

        def prepare() -> None:
            t = time.perf_counter()
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                check()
                framed = (staged or stage()).run()
                self._digests = {k: d for k, d in self._digests.items() if k > v - self.max_staleness - 2}
                self._digests[v] = mf.manifest_digest(framed.manifest).hex()
                self.server.publish(framed)
            self._publish_bg_s = time.perf_counter() - t

        async def announce() -> None:
            self.state.versions_published += 1
            await self._point_registry(v)
            self.health.set_serving(not self._stop.is_set())

        self.publisher.start(v, prepare, announce)
        return blocked

    async def _point_registry(self, version: int | None = None) -> None:
        """Point policy:latest at `version` (default: the newest version the server holds; none yet: nothing)."""
        version = version or max(self.server.versions(), default=0)
        if not version:
            return
        await self.registry.publish(
            PolicyPointer(
                version=version,
                address=self.cfg.grpc_advertise or self.server.address,
                contract_fingerprint=self.accepted_fingerprint,
                published_at=time.time(),
                content_digest=self._digests[version],  # what workers trust, whoever serves the bytes
            )
        )

    @property
    def _seq_key(self) -> str:
        return self.keys.prefix + "prompt_seq"  # Redis's copy of State.prompt_seq: gone = Redis lost data

    @property
    def _nonce_key(self) -> str:
        return self.keys.prefix + "trainer_nonce"  # this incarnation's random mark: no retried write restores it

    async def _reconcile_prompts(self) -> None:
        """At start: prompts fed after the checkpoint and still queued in Redis are ours too; if Redis
        lost prompts we fed (its prompt_seq marker is missing or behind), feed the outstanding again.
        This incarnation's nonce is written first: a loss after this line is seen by the next feed."""
        await self.redis.set(self._nonce_key, self._nonce)
        raw = await self.redis.get(self._seq_key)
        marker = None if raw is None else int(raw)
        if marker is not None and marker >= self.state.prompt_seq:
            for i in range(self.state.prompt_seq, marker):
                self.state.outstanding[self.make_prompt(i).group_id] = i
            self.state.prompt_seq = marker
        elif self.state.prompt_seq > 0:
            await self._refeed(f"prompt_seq in Redis is {marker}, the checkpoint's {self.state.prompt_seq}")

    async def _refeed(self, why: str) -> None:
        """Redis lost what was fed: a new nonce (a later loss is seen again), every outstanding group fed
        again (also those whose samples this trainer holds: a copy completes whatever is missing, the
        rest are dropped as duplicates), and the samples read so far no longer counted as Redis's."""
        self._nonce = secrets.token_hex(16)
        await self.redis.set(self._nonce_key, self._nonce)
        held = [r for g in (*self._backlog.incomplete.values(), *self._backlog.complete) for r in g]
        self._lost_ids = {*self._consumed_ids(), *(r.stream_id for r in held)}
        groups = [self.make_prompt(i) for i in sorted(self.state.outstanding.values())]
        await self.prompts.add(groups)
        await self.redis.set(self._seq_key, self.state.prompt_seq)
        self.state.refed += len(groups)
        self.log(f"Redis lost its data ({why}): fed the {len(groups)} outstanding groups again")
        await self._point_registry()  # policy:latest may be gone too

    def _consumed_ids(self):
        """Stream ids of the samples consumed or refused and not yet committed (Redis still lists them)."""
        yield from (sid for sid, _ in self.state.pending_commit)
        yield from (r.stream_id for r in self._consumed)
        yield from (r.stream_id for r, _ in self._rejected)

    def _fed_prompt(self, group_id: str) -> np.ndarray | None:
        """The prompt tokens fed as `group_id`, while it is outstanding (fed, not yet used or dropped)."""
        if group_id not in self.state.outstanding:
            return None
        if group_id not in self._fed_tokens:
            self._fed_tokens[group_id] = self.make_prompt(self.state.outstanding[group_id]).prompt_tokens
        return self._fed_tokens[group_id]

    def _settle(self, group_id: str, *, dropped: bool) -> None:
        """The group was used or dropped (listed in the next audit line): any later sample of it is refused."""
        if self.state.outstanding.pop(group_id, None) is not None and dropped:
            self.state.dropped_unaudited.append(group_id)
        self._fed_tokens.pop(group_id, None)
        self._settled_recent[group_id] = None
        while len(self._settled_recent) > 100_000:
            del self._settled_recent[next(iter(self._settled_recent))]

    async def _settle_dead_lettered(self) -> None:
        """Fed groups the workers dead-lettered (a prompt they cannot run, a poison pill) are settled
        as dropped: listed in the next audit line, counted, never outstanding or fed again. Not a group
        some of whose samples are held (a worker cut off from Redis finished it after all): that one
        trains or drops as any other."""
        held = self._backlog.group_ids
        while True:
            dead = await read_deadletter(self.redis, self.keys, count=256, start=self._deadletter_from)
            if not dead:
                return
            self._deadletter_from = "(" + dead[-1].id
            for d in dead:
                group_id = self._fed_group_of(d)
                if group_id is not None and group_id not in held:
                    self._settle(group_id, dropped=True)
                    self.state.prompts_dead_lettered += 1
                    self.log(f"prompt {group_id!r} dead-lettered by {d.consumer[:40]!r} ({d.reason[:200]}): dropped")
            if len(dead) < 256:
                return

    def _fed_group_of(self, dead: DeadLetter) -> str | None:
        """The outstanding group a dead letter holds: the very prompt fed under its group id (a
        refused forgery borrowing the id leaves the real prompt outstanding); else None."""
        if dead.source != self.keys.prompts:
            return None
        try:
            group = decode_prompt_group(dead.fields.get(DATA_FIELD))
        except CodecError:
            return None  # not a prompt of ours
        index = self.state.outstanding.get(group.group_id)
        if index is None or _prompt_key(group) != _prompt_key(self.make_prompt(index)):
            return None
        return group.group_id

    async def _feed_prompts(self) -> None:
        """Keep about `queued_groups` prompt groups queued or in flight (not more: they would go stale);
        first, feed again what Redis lost (the rules: trainer.feeding)."""
        seen = await self.redis.mget([self._nonce_key, self._seq_key])
        lost = feeding.redis_lost(*seen, nonce=self._nonce, prompt_seq=self.state.prompt_seq)
        if lost is not None:
            await self._refeed(lost)
        queued = feeding.queued_groups(
            _group_backlog(await self.prompts.stats(), self.prompts.group),
            _group_backlog(await self.stream.stats(), self.stream.group),
            consumed=sum(sid not in self._lost_ids for sid in self._consumed_ids()),
            group_size=self.cfg.group_size,
            outstanding=len(self.state.outstanding),
        )
        q = self.cfg.queued_groups(self.max_staleness)
        want = q - queued
        if want > 0:
            first = self.state.prompt_seq
            groups = [self.make_prompt(i) for i in range(first, first + want)]
            self.state.outstanding.update((g.group_id, i) for i, g in zip(range(first, first + want), groups))
            self.state.prompt_seq = first + want
            await self.prompts.add(groups)
            await self.redis.set(self._seq_key, self.state.prompt_seq)
            # Prompts lost on the way (e.g. dead-lettered by the workers) would stay outstanding forever.
            cap = 20 * q + 100
            if len(self.state.outstanding) > cap:
                for gid, _ in sorted(self.state.outstanding.items(), key=lambda kv: kv[1])[
                    : len(self.state.outstanding) - cap
                ]:
                    self._settle(gid, dropped=True)

    # ------------------------------------------------------------------ collect
    async def _collect(self) -> tuple[list[list[Trajectory]] | None, list[TrajectoryRecord]]:
        """Read until `groups_per_step` complete, admissible groups are held (the rules:
        `trainer.admission`); drops are counted, and consumed with the trained groups."""
        consumed = self._consumed = []  # drops count as consumed for _feed_prompts at once
        deadline = time.monotonic() + self.cfg.collect_timeout_s
        records: list[TrajectoryRecord] | None = None  # first pass: the backlog alone, at this version
        while True:
            decision = admission.admit(
                self._backlog,
                records or [],
                version=self.state.version,
                max_staleness=self.max_staleness,
                fingerprint=self.accepted_fingerprint,
                groups_per_step=self.cfg.groups_per_step,
            )
            self._backlog = decision.backlog
            held = self._backlog.group_ids
            for drop in decision.drops:
                t = drop.record.trajectory
                if drop.reason == admission.FINGERPRINT:
                    # Counted now, dead-lettered after the next checkpoint (so a crash recounts it once).
                    self.state.dropped_fingerprint += 1
                    self._reject(drop.record, f"contract fingerprint {t.contract_fingerprint[:12]} != trainer's "
                                 f"{self.accepted_fingerprint[:12]}")  # fmt: skip
                else:
                    self.state.dropped_stale += 1
                    consumed.append(drop.record)
                    if t.group_id not in held:
                        self._settle(t.group_id, dropped=True)
            if records is not None:  # after every read, as in the read loop
                await self._feed_prompts()
            if decision.train:
                break
            if self._stop.is_set():
                return None, []
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no complete trajectory group for {self.cfg.collect_timeout_s}s: are rollout workers running?"
                )
            records = await self.stream.read(admit=functools.partial(self._admissible, consumed=consumed))
        consumed += [r for g in decision.train for r in g]
        self._consumed = []  # the caller adds them to pending_commit
        for g in decision.train:
            self._settle(g[0].trajectory.group_id, dropped=False)
        return [[r.trajectory for r in g] for g in decision.train], consumed

    def _admissible(self, rec: TrajectoryRecord, consumed: list) -> bool:
        """Whether admission may see `rec` (called by the stream's read on every decoded record, before
        it marks any sample id held): each sample admission would keep (this contract, fresh enough)
        must pass trainer.validation first; one that fails is refused alone, with its reason, and
        never takes its sample id from a genuine copy. Samples of groups already settled go to
        `consumed` (committed as duplicates)."""
        t = rec.trajectory
        stale = admission.staleness(self.state.version, rec) > self.max_staleness
        if t.contract_fingerprint != self.accepted_fingerprint or stale:
            return True  # admission drops it, counted under its own reason
        fed = self._fed_prompt(t.group_id)
        if fed is None and t.group_id in self._settled_recent:
            # Already used or dropped, and Redis forgot its idempotency key (lost writes).
            self.state.duplicates += 1
            consumed.append(rec)
            return False
        reason = check_trajectory(t, self.rules, version=self.state.version, fed_prompt=fed)
        if reason is None:
            return True
        self.state.invalid += 1
        self._reject(rec, f"invalid: {reason}")
        if self.state.invalid <= 10 or self.state.invalid % 1000 == 0:  # a flood is not a log flood
            self.log(f"refused sample {t.sample_id[:80]!r} from {t.worker_id[:40]!r} (#{self.state.invalid}): {reason}")
        return False

    def _reject(self, rec: TrajectoryRecord, reason: str) -> None:
        """Dead-lettered at the next commit (not marked used: its sample id may come again, for real)."""
        self._rejected.append((rec, reason))
        self.stream.forget(rec)

    # ------------------------------------------------------------------ the GRPO step
    def recompute_logprobs(self, groups: list[list[Trajectory]]) -> Batch:
        """Pack the groups into one batch with advantages, and recompute its log-probs (no grad):
        `prox` under the current weights (the PPO proximal policy) and `at_version` under each
        sample's own version v (the quantization part of the mismatch): from v's retained packed
        tensors (trainer.versions), or `prox` itself where the weights are still v's."""
        t0 = time.perf_counter()
        samples = [t for g in groups for t in g]
        tokens, targets, attn, mask = pack(
            [t.prompt_tokens.tolist() for t in samples], [t.completion_tokens.tolist() for t in samples], self.pad_id
        )
        behav = scatter_rows([t.behavior_logprobs for t in samples], mask)
        rewards = torch.tensor([t.reward for t in samples], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, self.cfg.group_size)
        versions = torch.tensor([t.policy_version for t in samples])
        tokens, targets, attn, mask, behav, rewards, adv = (
            t.to(self.device) for t in (tokens, targets, attn, mask, behav, rewards, adv)
        )

        with torch.no_grad(), self.autocast:
            prox = self.backend.token_logprobs(tokens, targets, attention_mask=attn, temperature=self.temperature)
            at_version = prox.clone()
            self._sync()
            t1 = time.perf_counter()
            known = torch.ones(len(samples), dtype=torch.bool)  # rows whose version's weights we hold
            for v in sorted(set(versions.tolist())):
                if v == self._weights_version:
                    continue  # the current weights are version v (not moved since its publish): prox
                if v not in self.versions:  # from before a restart: left out of the split
                    known[versions == v] = False
                    continue
                rows = (versions == v).nonzero().squeeze(-1).to(self.device)
                at_version[rows] = self.versions.token_logprobs(
                    v, tokens[rows], targets[rows], attention_mask=attn[rows], temperature=self.temperature
                )
        self._sync()
        t2 = time.perf_counter()
        return Batch(
            tokens, targets, attn, mask, behav, rewards, adv, versions, prox, at_version, t0,
            known=known, recompute_s=t2 - t0, at_version_s=t2 - t1,
        )  # fmt: skip

    def _sync(self) -> None:
        """Wait for the trainer's own queued device work (recompute_s is device time, not launch
        time): its current stream only, not the whole device, whose side streams may hold an
        in-flight publish's copies to the host (broker.frames.fill) that this step need not wait for."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def optimize(self, b: Batch) -> dict:
        """The GRPO update over `minibatches` shuffled minibatches; returns the step's metrics row."""
        cfg = self.cfg
        n_tokens = int(b.mask.sum())
        grad_norms, stats = [], Counter()
        for rows in torch.randperm(len(b.rewards)).chunk(cfg.minibatches):
            rows = rows.to(self.device)
            with self.autocast:
                logp = self.backend.token_logprobs(
                    b.tokens[rows], b.targets[rows], attention_mask=b.attn[rows], temperature=self.temperature
                )
            loss, s = grpo.policy_loss(
                logp,
                b.prox[rows],
                b.behav[rows],
                b.adv[rows],
                b.mask[rows],
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                tis_cap=cfg.tis_cap,
                n_tokens=n_tokens,
            )
            grad_norms.append(self.backend.update(loss * cfg.minibatches))  # n_tokens is the step's: rescale
            stats.update(s)

        staleness = (self.state.version - b.versions).tolist()
        row = {
            "reward_mean": float(b.rewards.mean()),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "staleness_hist": dict(Counter(str(s) for s in staleness)),
            "dropped_stale": self.state.dropped_stale,
            "dropped_fingerprint": self.state.dropped_fingerprint,
            **self._drop_counters(),
            **grpo.mismatch_metrics(b.prox, b.behav, b.at_version, b.mask, version_known=b.known),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "clip_frac": stats["clip_frac"] / cfg.minibatches,
            "tis_frac": stats["tis_frac"] / cfg.minibatches,
            "samples": len(b.rewards),
            "completion_tokens": n_tokens,
            "step_time_s": time.perf_counter() - b.started,
            "recompute_s": b.recompute_s,
            "at_version_s": b.at_version_s,
            "rollout_recipe": self.rollout_recipe.name,
            "contract_breaking": self.contract_breaking,
        }
        return row

    def _drop_counters(self) -> dict:
        """Run totals of everything dropped (also persisted in the checkpoint)."""
        c, s = self.stream.counters, self.state
        for name in ("duplicates", "malformed", "dead_lettered", "unsigned"):
            setattr(s, name, getattr(s, name) + getattr(c, name))
            setattr(c, name, 0)
        names = ("duplicates", "malformed", "invalid", "dead_lettered", "unsigned", "refed", "prompts_dead_lettered")
        return {k: getattr(s, k) for k in names}


def checkpoints(folder: Path) -> list[Path]:
    """The trainer's checkpoint files in `folder`, oldest first (a run folder's `checkpoints/`)."""
    return sorted(Path(folder).glob("step-*.pt"))


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint in `folder` (or the single `trainer.pt` of older versions), or None."""
    found = checkpoints(folder)
    legacy = Path(folder) / "trainer.pt"
    return found[-1] if found else legacy if legacy.exists() else None


def checkpoint_of_version(folder: Path, version: int | None = None) -> tuple[Path, dict]:
    """(path, checkpoint) of the newest checkpoint in `folder` whose `model` holds exactly the
    weights of policy `version` (default: the newest such); ValueError listing what is kept."""
    found = checkpoints(folder) or [p for p in [latest_checkpoint(folder)] if p]
    kept = []
    for path in reversed(found):
        ck = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain types only
        held = {ck.get("weights_version", ck["state"]["version"]): ck["model"]}
        held.update({int(v): w for v, w in ck.get("snapshots", {}).items()})  # trainer.pt of older versions
        held.pop(None, None)
        kept += sorted(held)
        want = max(held, default=None) if version is None else version
        if want in held:
            return path, {**ck, "model": held[want], "weights_version": want}
    raise ValueError(
        f"no checkpoint in {folder} holds the weights of version {version if version is not None else 'any'}"
        f" (kept: {', '.join(str(v) for v in sorted(set(kept))) or 'none'})"
    )


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep the lines of steps <= max_step; a last line without its newline (a write cut short) is
    dropped. Rewritten in place: the MetricsSink already holds the file open for appending."""
    if path.exists():
        complete = path.read_text().split("\n")[:-1]  # what follows the last newline is incomplete
        keep = [ln for ln in complete if ln.strip() and json.loads(ln)["step"] <= max_step]
        path.write_text("".join(ln + "\n" for ln in keep))


def _prompt_key(g: PromptGroup) -> tuple:
    """What makes a prompt group the one fed (everything but when it was made)."""
    return g.group_id, g.prompt_id, g.n_samples, g.task, g.prompt_tokens.tobytes()


def _group_backlog(stats: dict, group: str) -> int | None:
    """Entries of `group` not yet acked: never delivered (lag) plus delivered and pending; None where
    Redis has no such group (it lost it)."""
    g = stats["groups"].get(group)
    return None if g is None else g["lag"] + g["pending"]
