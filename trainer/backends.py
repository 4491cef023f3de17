"""The trainer's model backends: one small interface, two implementations (`trainer.backend`).

The trainer's components (trainer.step, trainer.publishing, trainer.service) talk to a backend only
through these methods, so the loop is the same for both:
    token_logprobs(tokens, targets, attention_mask=, temperature=, routes=)  -> [B, T] fp32 (autograd on;
        routes: routing replay's forced expert ids, the torch backend only)
    update(loss) -> grad norm        zero grads, backward, clip, optimizer step, refresh the QAT cache
    set_lr(lr); canonical(); load_weights({name: tensor}); state_dict() / load_state_dict()
    apply_qat() / qat_hook; quantized_params(); finite_check()   QAT, publishing, the NaN/Inf test
    parameters(), train(), eval()    so that trainer.warmstart.warm_start takes a backend as a model

Both keep fp32 master weights and AdamW state, compute under bf16 autocast on CUDA (`trainer.dtype`),
and quantize for QAT and publishing from the masters with the same policy.qat hook and
policy.manifest code: for the same weights the published bytes are equal bit for bit
(tests/gpu/test_trainer_gpu.py). TorchBackend: policy.model.Transformer, torch AdamW (fused on
CUDA). MegatronBackend: a megatron-core GPTModel of the same architecture (`MegatronBackend`)."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe

from .config import TrainerConfig


def make_backend(cfg: TrainerConfig, model_config: ModelConfig, recipe: Recipe, *, seed: int, exact: bool = False):
    """The backend `cfg.backend` names, on `cfg.device`, with weights initialized from `seed`; exact:
    the torch backend's QAT forward in exact mode (loop.exact; megatron has none)."""
    if cfg.backend == "megatron":
        if exact:
            raise ValueError("loop.exact=true needs trainer.backend='torch' (no exact megatron forward)")
        return MegatronBackend(cfg, model_config, recipe, seed=seed)
    return TorchBackend(cfg, model_config, recipe, seed=seed, exact=exact)


class _Backend:
    """What both backends share: the optimizer update, QAT installation, checkpoint state."""

    name = ""
    cfg: TrainerConfig
    recipe: Recipe
    module: torch.nn.Module  # the model the optimizer steps
    optimizer: torch.optim.Optimizer
    qat_hook: qat.QATHook | None = None

    def _adamw(self) -> torch.optim.Optimizer:
        c = self.cfg
        return torch.optim.AdamW(
            self.module.parameters(),
            lr=c.lr,
            betas=c.betas,
            weight_decay=c.weight_decay,
            fused=c.device.startswith("cuda"),
        )

    def autocast(self):
        """bf16 autocast on CUDA with trainer.dtype bfloat16 (off on the CPU: fp32 there)."""
        bf16 = self.cfg.device.startswith("cuda") and self.cfg.dtype == "bfloat16"
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the optimizer's next updates (trainer.lr_schedule)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update(self, loss: Tensor) -> float:
        """One optimizer update on `loss`: backward, clip to `grad_clip`, step, refresh the QAT cache."""
        self.zero_grad()
        loss.backward()
        return self.step()

    def zero_grad(self) -> None:
        """Start an update whose gradients the caller accumulates (`loss.backward()` per micro-batch),
        ended by `step`."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """End an update begun by `zero_grad`: clip to `grad_clip`, step, refresh the QAT cache; the norm."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip))
        self.optimizer.step()
        if self.qat_hook is not None:
            self.qat_hook.invalidate()  # explicit: a fused optimizer bumps no version counter
        return norm

    def quantized_params(self, *, check_finite: bool = True) -> dict:
        """check_finite=False: the caller checks the master weights itself (`finite_check`)."""
        if check_finite:
            self.finite_check()()
        return self.qat_hook.quantized_params(self.module)

    def finite_check(self) -> Callable[[], None]:
        """Queue a NaN/Inf test of every master weight (no host sync: the QAT cache quantizes without
        the per-tensor check, see policy.qat) and return the check: calling it (any thread) reads the
        result in one sync and raises ValueError naming the first master weights that failed."""
        tensors = self.canonical()
        names, ok = list(tensors), torch.stack([t.isfinite().all() for t in tensors.values()])

        def check() -> None:
            bad = [n for n, good in zip(names, ok.tolist()) if not good]
            if bad:
                raise ValueError(f"non-finite master weights, not published: {', '.join(bad[:3])}")

        return check

    def state_dict(self) -> dict:
        return {"model": self.canonical(), "optimizer": self.optimizer.state_dict(), "backend": self.name}

    def load_state_dict(self, ck: dict) -> None:
        backend = ck.get("backend", "torch")
        if backend != self.name:
            raise ValueError(
                f"the checkpoint was written by trainer.backend={backend!r}, this run has {self.name!r}: its "
                "optimizer state does not fit (start a new run, or export its weights and load them)"
            )
        self.load_weights(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])


class TorchBackend(_Backend):
    """policy.model.Transformer with torch AdamW; exact: its QAT hook computes in exact mode
    (policy.exact), for the recompute and the training forward alike."""

    name = "torch"

    def __init__(
        self, cfg: TrainerConfig, model_config: ModelConfig, recipe: Recipe, *, seed: int, exact: bool = False
    ):
        self.cfg, self.model_config, self.recipe, self.exact = cfg, model_config, recipe, exact
        with torch.device(cfg.device):
            self.module = self.model = Transformer(model_config, seed=seed)
        self.model.activation_checkpointing = cfg.activation_checkpointing
        self.optimizer = self._adamw()

    def token_logprobs(
        self,
        tokens,
        targets,
        *,
        attention_mask=None,
        temperature: float = 1.0,
        routes: Tensor | None = None,
        router_own: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """router_own: also return the router's own top-k ids per token and MoE layer (with `routes`
        replayed, where they may differ from the ids used)."""
        return self.model.token_logprobs(
            tokens, targets, attention_mask=attention_mask, temperature=temperature, routes=routes,
            return_routes=router_own, router_own=router_own,
        )  # fmt: skip

    def canonical(self) -> dict[str, Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def load_weights(self, tensors: dict[str, Tensor]) -> None:
        self.model.load_weights(tensors)

    def init_weights(self, fn: Callable[[Transformer], None]) -> None:
        fn(self.model)

    def apply_qat(self) -> None:
        self.qat_hook = qat.apply_qat(self.model, self.recipe, backward=self.cfg.backward, exact=self.exact)


class MegatronBackend(_Backend):
    """A megatron-core GPTModel (fp32 parameters, TP=1; trainer/megatron_backend.py) with torch AdamW.

    Under torchrun with more than one rank: megatron's DistributedDataParallel and distributed
    optimizer (optimizer state sharded over the data-parallel ranks, gradients reduce-scattered);
    that path is written but has run on one GPU only, and the trainer service itself runs one
    process. megatron's rotary embedding and attention need CUDA: the config refuses device "cpu".
    megatron takes RoPE positions 0..T-1 and a plain causal mask, so its batches must be right-padded
    (trainer.sequences.pack does): `token_logprobs` refuses any other padding with one line."""

    name = "megatron"

    def __init__(self, cfg: TrainerConfig, model_config: ModelConfig, recipe: Recipe, *, seed: int):
        from . import megatron_backend as mb

        if not cfg.device.startswith("cuda"):  # TrainerConfig refuses it too; this guards direct use
            raise ValueError("trainer.backend='megatron' needs trainer.device='cuda': its GPTModel runs on CUDA only")
        self.cfg, self.model_config, self.recipe, self.mb = cfg, model_config, recipe, mb
        if "WORLD_SIZE" not in os.environ and torch.device(cfg.device).index is not None:
            torch.cuda.set_device(torch.device(cfg.device))  # "cuda:N": megatron uses the current device
        _init_distributed()
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            mb.init_parallel(seed=seed)
        self.world = torch.distributed.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device())
        gpt = mb.build_gpt_model(model_config, dtype=torch.float32).to(device)
        # The same initial weights as the torch backend's for this seed (its init, on the same device).
        with device:
            init = Transformer(model_config, seed=seed)
        mb.load_canonical(gpt, model_config, dict(init.named_parameters()))
        del init
        if cfg.activation_checkpointing:
            mb.checkpoint_layers(gpt)
        self.gpt = gpt
        if self.world == 1:
            self.module = gpt
            self.optimizer = self._adamw()
        else:
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
            self.module = DistributedDataParallel(config=gpt.config, ddp_config=ddp, module=gpt)
            c = cfg
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=c.lr,
                    weight_decay=c.weight_decay,
                    adam_beta1=c.betas[0],
                    adam_beta2=c.betas[1],
                    clip_grad=c.grad_clip,
                    bf16=False,
                    params_dtype=torch.float32,
                    use_distributed_optimizer=True,
                ),
                [self.module],
            )

    def token_logprobs(
        self, tokens, targets, *, attention_mask=None, temperature: float = 1.0, routes: Tensor | None = None
    ) -> Tensor:
        if routes is not None:  # RunConfig refuses loop.routing_replay with this backend
            raise ValueError("trainer.backend='megatron' takes no forced routing (loop.routing_replay)")
        if attention_mask is not None:
            m = attention_mask.bool()
            if bool((m[:, 1:] & ~m[:, :-1]).any()):  # a real token after a pad
                raise ValueError("trainer.backend='megatron' needs right-padded batches (RoPE positions 0..T-1)")
        logits = self.mb.logits(self.module, tokens).float()
        if temperature != 1.0:
            logits = logits / temperature
        return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(dim=-1)

    def zero_grad(self) -> None:
        if self.world == 1:
            return super().zero_grad()
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        if self.world == 1:
            return super().step()
        self.module.finish_grad_sync()  # reduce-scatter of the gradients over the data-parallel group
        _, norm, _ = self.optimizer.step()  # clips, steps its fp32 shards, all-gathers the parameters
        if self.qat_hook is not None:
            self.qat_hook.invalidate()  # megatron writes the parameters through .data: no version bump
        return float(norm)

    def canonical(self) -> dict[str, Tensor]:
        return self.mb.canonical_state(self.gpt, self.model_config)

    def load_weights(self, tensors: dict[str, Tensor]) -> None:
        self.mb.load_canonical(self.gpt, self.model_config, tensors)
        if self.qat_hook is not None:
            self.qat_hook.invalidate()

    def init_weights(self, fn: Callable[[Transformer], None]) -> None:
        """`fn` fills a policy.model.Transformer (e.g. from a Hugging Face folder): one on the CPU,
        copied in."""
        m = Transformer(self.model_config, seed=None)
        fn(m)
        self.load_weights(dict(m.named_parameters()))

    def apply_qat(self) -> None:
        self.qat_hook = self.mb.apply_qat(self.gpt, self.model_config, self.recipe, self.cfg.backward)

    def quantized_params(self, *, check_finite: bool = True) -> dict:
        if check_finite:
            self.finite_check()()
        return self.qat_hook.quantized_params(self.gpt)


def _init_distributed() -> None:
    """torch.distributed for megatron: from torchrun's environment, else a one-process NCCL group on
    loopback."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(minutes=10)
    )
