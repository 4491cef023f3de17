"""Builds the trainer and a rollout worker from one RunConfig: the only place that imports both,
so the task (prompts, verifier, tokenizer; `rollout.tasks.Task`) is built here once per process and
injected into both sides: the task-agnostic trainer gets its prompts and warm-start examples as
callables, a rollout worker the task itself. The trainer's process (seed, CUDA environment, memory
cap) is set up here too, before its components are built (`setup_trainer_process`), and `serve`
runs a built trainer under the signal handlers and exit codes of a service."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import yaml

from broker.codec import PromptGroup
from broker.outage import outage_in
from broker.signing import load_signer
from broker.streams import run_async
from policy.checkpoint import load_hf_into, read_config
from policy.model import ModelConfig
from policy.recipe import Recipe
from rollout.evaluate import accuracy, heldout_accuracy
from rollout.tasks import Task, make_task
from rollout.worker import RolloutWorker
from trainer.config import TrainerConfig
from trainer.metrics import check_writers, make_writers
from trainer.parts import Parts, RunLink, TaskHooks, build_parts
from trainer.publisher import PublishError
from trainer.service import Trainer

from .config import ModelSection, RunConfig, dump
from .preflight import check_ports


def model_config_for(model: ModelSection, vocab_size: int) -> ModelConfig:
    """The run's model: the preset (vocab = the tokenizer's), or the checkpoint's config.json.

    With a checkpoint, an override must equal the checkpoint's value (max_seq_len excepted), and a
    preset must agree with it in every field but vocab_size and max_seq_len (a run takes neither
    from a preset)."""
    if not model.checkpoint:
        overrides = {"max_seq_len": 64, **model.overrides, "vocab_size": vocab_size}
        return ModelConfig.preset(model.preset or "tiny", **overrides)
    checkpoint = read_config(model.checkpoint).to_dict()
    cfg = ModelConfig.from_dict({**checkpoint, **model.overrides})  # validated, lists as tuples
    arch = sorted(k for k in model.overrides if k != "max_seq_len" and cfg.to_dict()[k] != checkpoint[k])
    if arch:
        raise ValueError(
            f"model.overrides {arch}: with model.checkpoint the architecture comes from its config.json "
            f"({', '.join(f'{k}={checkpoint[k]!r}' for k in arch)}; only max_seq_len may differ)"
        )
    if model.preset:
        preset = ModelConfig.preset(model.preset, **model.overrides).to_dict()
        diff = [
            f"{k}: preset {v!r}, checkpoint {cfg.to_dict()[k]!r}"
            for k, v in preset.items()
            if k not in ("vocab_size", "max_seq_len") and v != cfg.to_dict()[k]
        ]
        if diff:
            raise ValueError(f"model.preset={model.preset!r} disagrees with model.checkpoint: " + "; ".join(diff))
    if vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens, more than the checkpoint's vocab_size {cfg.vocab_size}"
        )
    return cfg


def task_and_model(cfg: RunConfig) -> tuple[Task, ModelConfig, Recipe]:
    task = make_task(cfg.task, seed=cfg.loop.seed)
    return task, model_config_for(cfg.model, task.tokenizer.vocab_size), load_recipe(cfg, cfg.recipe)


def load_recipe(cfg: RunConfig, name: str) -> Recipe:
    """Recipe `name` with the run's `keep_bf16` overrides applied."""
    recipe = Recipe.load(name)
    keep = {
        k: v
        for k, v in (("keep_bf16_last_fraction", cfg.keep_bf16.last_fraction), ("keep_bf16_first", cfg.keep_bf16.first))
        if v is not None
    }
    return dataclasses.replace(recipe, **keep) if keep else recipe


def rollout_recipe(cfg: RunConfig, recipe: Recipe) -> Recipe:
    """The recipe the rollouts run: `recipe` unless the `rollout_recipe` ablation knob names another."""
    return load_recipe(cfg, cfg.rollout_recipe) if cfg.contract_breaking else recipe


def initial_weights(cfg: RunConfig):
    """What the trainer starts from when it has no checkpoint of its own: the HF weights, or None (init)."""
    if not cfg.model.checkpoint:
        return None
    return lambda model: load_hf_into(model, cfg.model.checkpoint)


def check(cfg: RunConfig) -> ModelConfig:
    """Everything about `cfg` that can be checked without Redis or a process: the files it names,
    the task, the model preset and overrides, the recipe and its plan for that model. ValueError
    names the problem; returns the model's config."""
    check_files(cfg)
    try:
        task, model_config, recipe = task_and_model(cfg)
    except TypeError as e:  # a model override of the wrong type
        raise ValueError(f"model.overrides: {e}") from None
    recipe.plan(model_config)
    check_writers(cfg.logging)
    if cfg.trainer.eval_every:
        if not callable(getattr(task, "heldout_prompt", None)):
            raise ValueError(f"trainer.eval_every: task {cfg.task.name!r} has no heldout_prompt(index) (rollout.tasks)")
        task.heldout_prompt(0)  # a split with no held-out prompt says so here
    return model_config


def check_files(cfg: RunConfig) -> None:
    """Every file path of `cfg` that is set names a file: the TLS PEMs, the run secret (and its
    secret readable)."""
    missing = [f"trainer.{m}" for m in cfg.trainer.tls.missing_files()]
    missing += [f"rollout.{m}" for m in cfg.rollout.tls.missing_files()]
    if missing:
        raise ValueError("; ".join(missing))
    load_signer(cfg.run_secret_file, environ={})


def setup_trainer_process(cfg: TrainerConfig, *, seed: int) -> torch.device:
    """Set up the trainer's process for `cfg.device`: the torch seed, the CUDA allocator and MPS
    settings (read once, when CUDA starts: before anything touches the device; a user's own
    PYTORCH_CUDA_ALLOC_CONF wins) and the per-process memory cap; ValueError without a CUDA device."""
    torch.manual_seed(seed)
    device = torch.device(cfg.device)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but torch sees no CUDA device")
    # A step's allocations change size with every batch: expandable segments let freed blocks be reused.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cfg.mps_thread_percentage:  # read when the CUDA context is created (the first kernel)
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(cfg.mps_thread_percentage)
    if cfg.mps_client_priority:
        os.environ["CUDA_MPS_CLIENT_PRIORITY"] = str(cfg.mps_client_priority)
    if cfg.memory_fraction:  # processes sharing one GPU (configs/gpu-h200.yaml)
        torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, device.index or 0)
    return device


def trainer_parts(cfg: RunConfig, run_dir) -> Parts:
    """The trainer's components for `cfg`, its process set up first (`setup_trainer_process`)."""
    task, model_config, recipe = task_and_model(cfg)
    device = setup_trainer_process(cfg.trainer, seed=cfg.loop.seed)

    def make_prompt(index: int) -> PromptGroup:
        # Prompt i is a pure function of (seed, i): a restarted trainer feeds the same data.
        p = task.prompt(index)
        return PromptGroup(
            prompt_id=f"p{index}",
            group_id=f"p{index}",
            prompt_tokens=np.asarray(p.tokens, dtype=np.int32),
            n_samples=cfg.trainer.group_size,
            task=p.fields,
            created_at=time.time(),
        )

    warm_rng = random.Random(cfg.loop.seed + 17)

    def example():
        p = task.example(warm_rng)
        return p.tokens, p.reference

    hooks = TaskHooks(
        make_prompt=make_prompt,
        warm_start_example=example,
        pad_id=task.tokenizer.pad_id,
        max_completion_tokens=task.max_new_tokens,
        init_weights=initial_weights(cfg),
        evaluate=evaluation(cfg, task),
        warmstart_score=warmstart_score(cfg, task),
    )
    link = RunLink(
        run_id=cfg.run_id,
        redis_url=cfg.redis_url,
        redis_outage_s=cfg.redis_outage_s,
        signer=load_signer(cfg.run_secret_file),
        run_dir=Path(run_dir),
    )
    return build_parts(
        cfg.trainer, link=link, task=hooks, loop=cfg.loop, model_config=model_config, recipe=recipe,
        rollout_recipe=rollout_recipe(cfg, recipe), device=device, log=trainer_log,
        writers=make_writers(cfg.logging, run_dir, name=cfg.run_id, config=yaml.safe_load(dump(cfg))),
    )  # fmt: skip


def trainer_log(line: str) -> None:
    print(f"[trainer] {line}", flush=True)


def make_trainer(cfg: RunConfig, run_dir) -> Trainer:
    return Trainer(cfg.trainer, trainer_parts(cfg, run_dir), log=trainer_log)


def evaluation(cfg: RunConfig, task: Task):
    """trainer.eval_every's evaluation: held-out accuracy of a model (rollout.evaluate), or None when off."""
    if not cfg.trainer.eval_every:
        return None
    k, temperature, seed = cfg.trainer.eval_prompts, cfg.loop.temperature, cfg.loop.seed
    return lambda model: heldout_accuracy(model, task, k=k, temperature=temperature, seed=seed)


def warmstart_score(cfg: RunConfig, task: Task):
    """trainer.warmstart_until's score: the sampled accuracy on the task's first eval_prompts
    training prompts (the RL's first prompts) at loop.temperature, or None when off."""
    if not cfg.trainer.warmstart_until:
        return None
    prompts = [task.prompt(i) for i in range(cfg.trainer.eval_prompts)]
    return lambda model: accuracy(model, task, prompts, temperature=cfg.loop.temperature, seed=cfg.loop.seed)


def make_worker(cfg: RunConfig, worker_id: str) -> RolloutWorker:
    task, model_config, recipe = task_and_model(cfg)
    return RolloutWorker(
        cfg.rollout,
        run_id=cfg.run_id,
        redis_url=cfg.redis_url,
        worker_id=worker_id,
        model_config=model_config,
        recipe=rollout_recipe(cfg, recipe),
        loop=cfg.loop,
        redis_outage_s=cfg.redis_outage_s,
        signer=load_signer(cfg.run_secret_file),
        task=task,
        group_size=cfg.trainer.group_size,
        log=lambda s: print(f"[rollout] {s}", flush=True),
    )


def serve_trainer(cfg: RunConfig, run_dir) -> int:
    check_ports(cfg, "trainer")  # a port another program holds: one line naming the key (exit 2)
    return serve(make_trainer(cfg, run_dir))


def serve(trainer: Trainer) -> int:
    """Run `trainer` until it finishes or SIGTERM/SIGINT stops it; its exit code."""

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, trainer.request_stop)
        return await trainer.run()

    return _exit_on_outage(lambda: run_async(main()), "trainer")


def serve_rollout(cfg: RunConfig, worker_id: str) -> int:
    check_ports(cfg, "rollout")
    worker = make_worker(cfg, worker_id)

    async def main():
        worker.install_signal_handlers()
        return await worker.run()

    return _exit_on_outage(lambda: run_async(main()), f"rollout {worker_id}")


REDIS_OUTAGE_EXIT = 3
PUBLISH_FAILED_EXIT = 1


def _exit_on_outage(run: Callable[[], int], who: str) -> int:
    """Run a service. Past `redis_outage_s` of Redis outage (wherever it surfaced: a background task,
    a publish, a `finally`): one line, exit code 3 (restart me). A publish that failed for good (its
    serving child dying at every attempt): one line, exit code 1. Anything else is a bug: raised."""
    try:
        return run()
    except Exception as e:
        outage = outage_in(e, context=True)
        if outage is not None:
            print(f"[{who}] giving up: {outage}", file=sys.stderr, flush=True)
            return REDIS_OUTAGE_EXIT
        if not isinstance(e, PublishError):
            raise
        print(f"[{who}] giving up: {e}", file=sys.stderr, flush=True)
        return PUBLISH_FAILED_EXIT
