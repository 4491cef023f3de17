"""Builds the trainer and a rollout worker from one RunConfig: the only place that imports both,
so the task (prompts, verifier, tokenizer) is wired into the task-agnostic trainer here."""

from __future__ import annotations

import asyncio
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

from .config import RunConfig


def task_and_model(cfg: RunConfig) -> tuple[AdditionTask, CharTokenizer, ModelConfig, Recipe]:
    tok = CharTokenizer()
    task = AdditionTask(digits=cfg.task.digits)
    overrides = {"max_seq_len": 64, **cfg.model.overrides, "vocab_size": tok.vocab_size}
    return task, tok, ModelConfig.preset(cfg.model.preset, **overrides), Recipe.load(cfg.recipe)


def check(cfg: RunConfig) -> None:
    """Everything about `cfg` that can be checked without Redis or a process: the task, the model
    preset and overrides, the recipe and its plan for that model. ValueError names the problem."""
    try:
        _, _, model_config, recipe = task_and_model(cfg)
    except TypeError as e:  # a model override of the wrong type
        raise ValueError(f"model.overrides: {e}") from None
    recipe.plan(model_config)


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
