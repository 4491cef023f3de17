"""Builds the trainer and a rollout worker from one RunConfig: the only place that imports both,
so the task (prompts, verifier, tokenizer) is wired into the task-agnostic trainer here."""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from collections.abc import Callable

import numpy as np

from broker.codec import PromptGroup
from broker.outage import RedisOutage
from broker.signing import load_signer
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
        redis_outage_s=cfg.redis_outage_s,
        signer=load_signer(cfg.run_secret_file),
        run_dir=run_dir,
        seed=cfg.seed,
        temperature=cfg.rollout.temperature,
        make_prompt=make_prompt,
        warm_start_example=example,
        pad_id=tok.pad_id,
        max_completion_tokens=task.max_answer_tokens,
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
        redis_outage_s=cfg.redis_outage_s,
        signer=load_signer(cfg.run_secret_file),
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

    return _exit_on_outage(lambda: run_async(main()), "trainer")


def serve_rollout(cfg: RunConfig, worker_id: str) -> int:
    worker = make_worker(cfg, worker_id)

    async def main():
        worker.install_signal_handlers()
        return await worker.run()

    return _exit_on_outage(lambda: run_async(main()), f"rollout {worker_id}")


REDIS_OUTAGE_EXIT = 3


def _exit_on_outage(run: Callable[[], int], who: str) -> int:
    """Run a service; past `redis_outage_s` of Redis outage: one line, exit code 3 (restart me)."""
    try:
        return run()
    except RedisOutage as e:
        print(f"[{who}] giving up: {e}", file=sys.stderr, flush=True)
        return REDIS_OUTAGE_EXIT
