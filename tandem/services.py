"""Builds the trainer and a rollout worker from one RunConfig: the only place that imports both,
so the task (prompts, verifier, tokenizer) is wired into the task-agnostic trainer here."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import time

import numpy as np

from broker.codec import PromptGroup
from broker.streams import run_async
from policy.model import ModelConfig
from policy.recipe import Recipe
from rollout.tasks import AdditionTask, CharTokenizer
from rollout.worker import RolloutWorker
from trainer.service import Trainer

from .config import ModelSection, RunConfig


def model_config_for(model: ModelSection, vocab_size: int) -> ModelConfig:
    """The run's model: the preset (vocab = the tokenizer's), or the checkpoint's config.json."""
    if not model.checkpoint:
        overrides = {"max_seq_len": 64, **model.overrides, "vocab_size": vocab_size}
        return ModelConfig.preset(model.preset or "tiny", **overrides)
    from policy.checkpoint import read_config

    arch = sorted(set(model.overrides) - {"max_seq_len"})
    if arch:
        raise ValueError(
            f"model.overrides {arch}: with model.checkpoint the architecture comes from its config.json "
            "(only max_seq_len may be overridden)"
        )
    cfg = dataclasses.replace(read_config(model.checkpoint), **model.overrides)
    if model.preset:
        preset = ModelConfig.preset(model.preset, **model.overrides)
        diff = [
            f"{k}: preset {v!r}, checkpoint {cfg.to_dict()[k]!r}"
            for k, v in preset.to_dict().items()
            if v != cfg.to_dict()[k]
        ]
        if diff:
            raise ValueError(f"model.preset={model.preset!r} disagrees with model.checkpoint: " + "; ".join(diff))
    if vocab_size > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab_size} tokens, more than the checkpoint's vocab_size {cfg.vocab_size}"
        )
    return cfg


def task_and_model(cfg: RunConfig) -> tuple[AdditionTask, CharTokenizer, ModelConfig, Recipe]:
    tok = CharTokenizer()
    task = AdditionTask(digits=cfg.task.digits)
    return task, tok, model_config_for(cfg.model, tok.vocab_size), Recipe.load(cfg.recipe)


def initial_weights(cfg: RunConfig):
    """What the trainer starts from when it has no checkpoint of its own: the HF weights, or None (init)."""
    if not cfg.model.checkpoint:
        return None
    from policy.checkpoint import load_hf_into

    return lambda model: load_hf_into(model, cfg.model.checkpoint)


def make_trainer(cfg: RunConfig, run_dir) -> Trainer:
    task, tok, model_config, recipe = task_and_model(cfg)

    def make_prompt(index: int) -> PromptGroup:
        # Prompt i is a pure function of (seed, i): a restarted trainer feeds the same data.
        text, answer = task.sample(random.Random(cfg.seed * 1_000_003 + index))
        return PromptGroup(
            prompt_id=f"p{index}",
            group_id=f"p{index}",
            prompt_tokens=np.asarray(tok.encode(text, bos=True), dtype=np.int32),
            n_samples=cfg.trainer.group_size,
            task={"answer": answer},
            created_at=time.time(),
        )

    warm_rng = random.Random(cfg.seed + 17)

    def example():
        text, answer = task.sample(warm_rng)
        return tok.encode(text, bos=True), tok.encode(answer, eos=True)

    return Trainer(
        cfg.trainer,
        run_id=cfg.run_id,
        redis_url=cfg.redis_url,
        model_config=model_config,
        recipe=recipe,
        max_staleness=cfg.max_staleness,
        run_dir=run_dir,
        seed=cfg.seed,
        temperature=cfg.rollout.temperature,
        make_prompt=make_prompt,
        warm_start_example=example,
        pad_id=tok.pad_id,
        init_weights=initial_weights(cfg),
        log=lambda s: print(f"[trainer] {s}", flush=True),
    )


def make_worker(cfg: RunConfig, worker_id: str) -> RolloutWorker:
    task, tok, model_config, recipe = task_and_model(cfg)
    return RolloutWorker(
        cfg.rollout,
        run_id=cfg.run_id,
        redis_url=cfg.redis_url,
        worker_id=worker_id,
        model_config=model_config,
        recipe=recipe,
        max_staleness=cfg.max_staleness,
        task=task,
        tokenizer=tok,
        log=lambda s: print(f"[rollout] {s}", flush=True),
    )


def serve_trainer(cfg: RunConfig, run_dir) -> int:
    trainer = make_trainer(cfg, run_dir)

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, trainer.request_stop)
        return await trainer.run()

    return run_async(main())


def serve_rollout(cfg: RunConfig, worker_id: str) -> int:
    worker = make_worker(cfg, worker_id)

    async def main():
        worker.install_signal_handlers()
        return await worker.run()

    return run_async(main())
