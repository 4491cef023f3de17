"""The trainer's components, built once from its config: `build_parts` returns them as `Parts`,
and trainer.service.Trainer runs its loop over them. The process around them (environment, device,
seed, signals) is set up by the service wiring (tandem.services) before anything is built here.

The trainer is task-agnostic: the prompts it feeds, the warm-start examples and the evaluation come
from the callables in `TaskHooks`, which the `tandem trainer` command builds from the configured task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from broker import frames
from broker.codec import PromptGroup
from broker.health import TRAINER_HEALTH, HealthServer
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.server_process import ServingProcesses
from broker.signing import Signer, policy_token
from policy.loop import AsyncConfig, exact_refusal
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe

from .backends import make_backend
from .checkpoints import Checkpointer
from .config import TrainerConfig
from .metrics import MetricsSink, MetricWriter
from .publishing import Contracts, PolicyPublishing
from .state import State
from .step import GRPOStep
from .validation import TrajectoryRules
from .versions import RetainedVersions


@dataclass(frozen=True, kw_only=True)
class RunLink:
    """Where the run lives: its Redis (keys under the run id), its secret, its folder."""

    run_id: str
    redis_url: str
    redis_outage_s: float = 60.0
    signer: Signer | None = None
    run_dir: Path


@dataclass(frozen=True, kw_only=True)
class TaskHooks:
    make_prompt: Callable[[int], PromptGroup]  # prompt group i, a pure function of i
    warm_start_example: Callable[[], tuple[list[int], list[int]]]  # (prompt, answer) tokens
    pad_id: int
    max_completion_tokens: int = 64
    init_weights: Callable[[Transformer], None] | None = None  # used when no checkpoint of ours exists
    evaluate: Callable[[Transformer], dict] | None = None  # every `eval_every` steps; joins the metrics row
    warmstart_score: Callable[[Transformer], float] | None = None  # trainer.warmstart_until's accuracy


@dataclass(frozen=True, kw_only=True)
class Parts:
    link: RunLink
    task: TaskHooks
    loop: AsyncConfig
    state: State  # shared by the components; the metrics endpoint exports its counters
    backend: object  # trainer.backends: model, optimizer, QAT
    contracts: Contracts
    rules: TrajectoryRules
    step: GRPOStep
    publishing: PolicyPublishing
    checkpointer: Checkpointer
    metrics: MetricsSink
    health: HealthServer


def _replayed_layers(cfg: TrainerConfig, loop: AsyncConfig, model_config: ModelConfig) -> list[int] | None:
    """Routing replay: the MoE layers' indices (None: replay off, or a dense model with nothing to replay)."""
    if loop.routing_replay and cfg.backend == "megatron":
        raise ValueError("loop.routing_replay=true needs trainer.backend='torch' (megatron takes no forced routing)")
    if not loop.routing_replay:
        return None
    return [i for i in range(model_config.n_layers) if model_config.is_moe_layer(i)] or None


def build_parts(
    cfg: TrainerConfig,
    *,
    link: RunLink,
    task: TaskHooks,
    loop: AsyncConfig,
    model_config: ModelConfig,
    recipe: Recipe,
    rollout_recipe: Recipe | None = None,
    device: torch.device,
    writers: Sequence[MetricWriter] = (),
    log: Callable[[str], None] = print,
) -> Parts:
    """rollout_recipe: the ablation knob (None = `recipe`): publish under the rollouts' recipe and
    accept its fingerprint, breaking the contract on purpose. writers: fed every metrics row."""
    if cfg.eval_every and task.evaluate is None:
        raise ValueError(f"trainer.eval_every={cfg.eval_every} but the trainer was given no evaluation")
    if cfg.warmstart_until and task.warmstart_score is None:
        raise ValueError(f"trainer.warmstart_until={cfg.warmstart_until} but the trainer was given no score")
    replay = _replayed_layers(cfg, loop, model_config)
    if loop.exact and (why := exact_refusal(cfg.device, cfg.backend, cfg.dtype)):
        raise ValueError(why)
    backend = make_backend(cfg, model_config, recipe, seed=loop.seed, exact=loop.exact)
    contracts = Contracts.of(model_config, recipe, rollout_recipe)
    # The newest versions' packed tensors as their publish produced them (trainer.versions).
    versions = RetainedVersions(model_config, recipe.plan(model_config), keep=loop.max_staleness, exact=loop.exact)
    server, in_child = _policy_server(cfg, link.signer, device=device, keep=loop.max_staleness + 2, log=log)
    state = State()
    metrics = MetricsSink(
        link.run_dir / "metrics.jsonl",
        port=cfg.metrics_port,
        host=cfg.metrics_host,
        state=lambda: vars(state),
        writers=writers,
    )
    if metrics.endpoint is not None:
        metrics.endpoint.add_callback(server.prometheus_samples)
    rules = TrajectoryRules(
        group_size=cfg.group_size,
        vocab_size=model_config.vocab_size,
        max_seq_len=model_config.max_seq_len,
        max_completion_tokens=task.max_completion_tokens,
        max_abs_reward=cfg.max_abs_reward,
        routes=replay and (len(replay), model_config.top_k, model_config.n_experts),
    )
    step = GRPOStep(
        cfg, backend, versions, pad_id=task.pad_id, temperature=loop.temperature, device=device,
        max_staleness=loop.max_staleness, replay_routes=replay and (len(replay), model_config.top_k),
    )  # fmt: skip
    # Versions are framed into reusable host buffers (page-locked on CUDA; shared memory that the
    # server's process maps, when it has one).
    buffers = frames.BufferPool(pin=device.type == "cuda", shared=in_child)
    publishing = PolicyPublishing(
        backend, contracts, versions, server, buffers,
        advertise=cfg.grpc_advertise, keep_digests=loop.max_staleness + 2, device=device,
        relay_fanout=cfg.relay_fanout, log=log,
    )  # fmt: skip
    return Parts(
        link=link, task=task, loop=loop, state=state, backend=backend, contracts=contracts, rules=rules,
        step=step, publishing=publishing, metrics=metrics,
        checkpointer=Checkpointer(link.run_dir / "checkpoints", keep=cfg.keep_checkpoints, log=log),
        health=HealthServer(port=cfg.health.port, service=TRAINER_HEALTH, host=cfg.health.host),
    )  # fmt: skip


def _policy_server(cfg: TrainerConfig, signer: Signer | None, *, device: torch.device, keep: int, log):
    """(server, in_child): the policy server, in a child process on CUDA unless
    `policy_server_process` says otherwise (serving holds the GIL for every chunk)."""
    server_config = PolicyServerConfig(
        host=cfg.grpc_host,
        port=cfg.grpc_port,
        keep_versions=keep,
        reflection=cfg.grpc_reflection,
        tls=cfg.tls,
        fetch_deadline_s=cfg.fetch_deadline_s,
        stall_s=cfg.stall_s,
        run_token=policy_token(signer),
        serve_unauthenticated=cfg.serve_unauthenticated,
        max_unauthenticated_streams=cfg.max_unauthenticated_streams,
        max_streams_per_peer=cfg.max_streams_per_peer,
        deltas=cfg.policy_deltas,
        delta_full_every=cfg.delta_full_every,
    )
    in_child = device.type == "cuda" if cfg.policy_server_process is None else cfg.policy_server_process
    if in_child:
        return ServingProcesses(server_config, processes=cfg.policy_server_processes, log=log), True
    return PolicyServer(server_config), False
