"""The trainer's configuration: one frozen dataclass, validated with messages naming each field.

Each field is documented by the string below it (shown by `tandem run --explain trainer.KEY`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from broker.health import HealthConfig
from broker.registry import MAX_FANOUT
from broker.tls import ServerTLS
from policy.fields import is_int, is_number
from policy.tracing import TraceConfig

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """The RL steps' learning rate: trainer.lr times trainer.warmstart.lr_factor at each step."""

    kind: str = "constant"
    """After the warmup: "constant", or "linear" / "cosine" decay to min_lr_ratio * lr at max_steps."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr / warmup_steps to lr (0 = none)."""
    min_lr_ratio: float = 0.0
    """The decay's floor as a fraction of lr (0..1)."""

    def __post_init__(self):
        errors = []
        if self.kind not in LR_SCHEDULES:
            errors.append(f"trainer.lr_schedule.kind={self.kind!r} (one of {', '.join(LR_SCHEDULES)})")
        if not is_int(self.warmup_steps, lo=0):
            errors.append(f"trainer.lr_schedule.warmup_steps={self.warmup_steps!r} (an int >= 0)")
        if not 0 <= self.min_lr_ratio <= 1:
            errors.append(f"trainer.lr_schedule.min_lr_ratio={self.min_lr_ratio!r} (want 0..1)")
        if errors:
            raise ValueError("; ".join(errors))


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases: the metrics rows logged to a W&B run (offline: a folder in the run folder)."""

    enabled: bool = False
    """Log every metrics row to W&B (needs the wandb package)."""
    mode: str = "offline"
    """"offline" (the default: written under the run folder's wandb/, no network; `wandb sync` uploads
    it later) or "online" (needs a W&B login)."""
    project: str = "tandem"
    """The W&B project; the W&B run is named after run_id."""

    def __post_init__(self):
        if self.mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb.mode={self.mode!r} (offline or online)")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Writers fed the same rows as metrics.jsonl (trainer.metrics), each library imported only when on."""

    tensorboard: bool = False
    """Write every metrics row's numbers as TensorBoard scalars under the run folder's tensorboard/
    (needs the tensorboard package)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (offline by default)."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The `trainer:` section: the RL step, publishing, warm start and the service's ports."""

    # RL step
    max_steps: int = 100
    """Optimizer steps of the run."""
    groups_per_step: int = 16
    """Prompt groups consumed per optimizer step."""
    group_size: int = 8
    """Samples per prompt (the GRPO group), >= 2."""
    lr: float = 3e-4
    """AdamW learning rate of the RL steps (the peak, under lr_schedule)."""
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    """Warmup and decay of the RL steps' learning rate (a function of the step: resumes exactly)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip per update."""
    minibatches: int = 2
    """Optimizer updates per step; the PPO clip acts from the second one on."""
    microbatch_tokens: int = 0
    """Padded tokens (rows x row length) one forward takes at most: the recompute runs in chunks of
    rows this size, and each minibatch's update accumulates its gradient over such chunks (one
    optimizer update per minibatch whatever the chunking). 0 = a minibatch in one forward. Long
    completions need it: the fp32 logits alone are vocab x 4 bytes per token."""
    mismatch_split_rows: int = 0
    """Rows per step whose tokens of an older version are recomputed under that version's packed
    tensors for the mismatch split's quantization part (a diagnostic: the loss never uses it), spread
    evenly over the batch; the others are left out of the split. 0 = every row. Each older version
    costs one forward over its rows, which in an async run with long completions is a large part of
    the step."""
    clip_low: float = 0.2
    """PPO clip: ratio floor 1 - clip_low."""
    clip_high: float = 0.28
    """PPO clip: ratio ceiling 1 + clip_high."""
    tis_cap: float = 2.0
    """Truncated importance weight cap C on prox / behavior."""
    backward: str = "hp"
    """QAT straight-through mode: "hp" (master weights) or "dequant" (effective operands)."""
    device: str = "cpu"
    """Where the trainer computes: "cpu", "cuda" (the first visible GPU of this process) or "cuda:N"."""
    memory_fraction: float = 0.0
    """CUDA only: the share of the GPU's memory this process may allocate (torch's caching allocator,
    `torch.cuda.set_per_process_memory_fraction`), for processes sharing one GPU; 0 = no cap."""
    mps_thread_percentage: int = 0
    """Under NVIDIA MPS (processes sharing one GPU's SMs at once; bench/run_e2e_device.sh starts a
    daemon): the share of the SMs the trainer's kernels may occupy, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    set before the trainer's CUDA context exists, so that rollout workers' small decode kernels do
    not queue behind its GEMMs. 0 = no limit; without an MPS daemon it has no effect."""
    mps_client_priority: int = 0
    """Under NVIDIA MPS: the trainer's scheduling priority among the GPU's clients,
    CUDA_MPS_CLIENT_PRIORITY set before its CUDA context exists: 0 normal, 1 below normal (the
    workers' decode kernels go first when both wait). Without an MPS daemon it has no effect."""
    backend: str = "torch"
    """Trainer model implementation: "torch" (policy.model.Transformer) or "megatron" (a megatron-core
    GPTModel of the same architecture, trainer/megatron_backend.py; needs device "cuda" and the
    `megatron` extra)."""
    dtype: str = "bfloat16"
    """Compute dtype on CUDA: "bfloat16" (autocast; master weights and AdamW state stay fp32) or
    "float32". The CPU always computes in fp32 (bf16 matmuls there are slow and gain nothing)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the layer there: less
    activation memory (long sequences, big batches) for about one more forward per update."""
    # publishing (the staleness bound is the run's: loop.max_staleness, shared with the rollouts)
    publish_every: int = 1
    """Publish a new policy version every this many optimizer steps."""
    checkpoint_every: int = 10
    """Write checkpoints/step-NNNNNN.pt every this many steps (and at the last); the consumed
    samples are committed to Redis only then, so a crash re-delivers what the lost steps consumed.
    0 = never (benchmarks of large models: no checkpoint is written, samples are committed every
    step, and a restarted trainer starts over)."""
    keep_checkpoints: int = 2
    """Keep the newest this many checkpoint files, delete older ones."""
    prompts_ahead: int = 0
    """Prompt groups queued or in flight; 0 = groups_per_step * max(1, loop.max_staleness)."""
    # warm start: supervised steps on correct answers before RL, so the policy is sometimes right
    warmstart_steps: int = 150
    """Supervised steps on the task's reference answers before RL (0 = none)."""
    warmstart_batch: int = 64
    """Examples per warm-start step."""
    warmstart_lr: float = 3e-3
    """Learning rate of the warm start."""
    warmstart_until: float = 0.0
    """Stop the warm start early, at the first multiple of 10 steps where the sampled accuracy on
    the task's first `eval_prompts` training prompts (at loop.temperature, fixed seeds) is at least
    this; 0 = off (all warmstart_steps run). RL then starts from about this accuracy whatever the seed."""
    # held-out evaluation
    eval_every: int = 0
    """Every this many steps, greedy and sampled accuracy on held-out prompts the trainer never trains
    on (task.heldout_fraction or task.heldout_path), with the trainer's current weights: metrics
    eval_greedy_accuracy and eval_sampled_accuracy. 0 = off."""
    eval_prompts: int = 32
    """Prompts per evaluation, the same ones every time: held-out ones for eval_every, training ones
    for warmstart_until."""
    # services
    grpc_host: str = "127.0.0.1"
    """Address the policy gRPC server binds (a pod binds "0.0.0.0")."""
    grpc_port: int = 0
    """Port of the policy gRPC server; 0 = a free port (published in policy:latest)."""
    grpc_advertise: str = ""
    """host:port the rollouts dial, published in policy:latest; "" = the bound address. In a pod:
    the Service's DNS name (a bound 0.0.0.0 is no address to dial)."""
    tls: ServerTLS = field(default_factory=ServerTLS)
    """TLS of the policy gRPC (PEM paths): cert + key; a client_ca as well requires client
    certificates signed by it (mTLS)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """grpc.health.v1 for Kubernetes probes (plaintext: kubelet's gRPC probe cannot speak TLS):
    SERVING once a policy is published."""
    trace: TraceConfig = field(default_factory=TraceConfig)
    """A torch.profiler recording of GRPO steps (policy/tracing.py): trainer-trace.json and
    trainer-trace-summary.json in `trace.dir` (a GRPO step launches far more kernels than a decode
    step: `trace.steps` 1 or 2)."""
    metrics_port: int = 0
    """Prometheus metrics port; 0 = a free port, -1 = off, else that port (bound on metrics_host)."""
    metrics_host: str = "127.0.0.1"
    """Address the Prometheus port binds: loopback by default; in a pod its IP (the downward API's
    status.podIP, through TANDEM_TRAINER_METRICS_HOST), which Prometheus scrapes."""
    grpc_reflection: bool = True
    """gRPC server reflection on the policy port (grpcurl-style tools list the services); on for
    `tandem run`, off in the Kubernetes overlays."""
    fetch_deadline_s: float = 300.0
    """Server-side deadline of one FetchTensors stream (seconds): a rollout that stops reading is cut
    off and resumes at its next chunk; connections live at most twice this (broker.policy_server)."""
    stall_s: float = 5.0
    """A FetchTensors stream whose reader takes no chunk for this many seconds is ended (counted); the
    rollout resumes at its next chunk (broker.policy_server)."""
    serve_unauthenticated: bool = False
    """With a run secret, the policy gRPC serves only authenticated workers (the run token derived from
    the secret, or an mTLS client certificate); true also serves other clients, within
    max_unauthenticated_streams. Without a run secret nobody can be told apart: everybody is served."""
    max_unauthenticated_streams: int = 64
    """With a run secret and serve_unauthenticated: the streams all unauthenticated clients may hold
    together (the rest of the server's 256 is kept for workers)."""
    max_streams_per_peer: int = 16
    """Streams one unauthenticated client address may hold (without a run secret: every worker's)."""
    policy_server_process: bool | None = None
    """Serve policies from a child process (broker/server_process.py) instead of a thread of the
    trainer: serving a version holds the GIL for every chunk, which starved the training loop's kernel
    launches to 5% of their rate on the H200 host. null: on CUDA yes, on the CPU no (small versions)."""
    policy_server_processes: int = 1
    """With the server in child processes: how many serve the policy port together (SO_REUSEPORT;
    broker.server_process.ServingProcesses), so that serving is not one event loop's."""
    policy_deltas: bool = True
    """Serve a version as a delta (XOR + zstd per changed tensor, broker/delta.py) against a version the
    worker holds, when that is smaller than the full version. On by default: every rebuilt tensor is
    checked against the manifest's checksums (a bad delta is refused and fetched whole), the tests of
    whole runs (trainer + workers, faults included) pass with it on, and on the demo model a delta is
    10-35% of a full nvfp4_moe version per step (docs/benchmarks.md, "Delta
    versions on the demo model"). A bare PolicyServerConfig keeps it off (the server's own tests
    count full versions' bytes). Off: every fetch is a full version."""
    delta_full_every: int = 16
    """With policy_deltas: every this-many-th publish (the first included) is served only as a full
    version, so a worker rebuilds at most delta_full_every - 1 versions in a row from deltas. The
    mean cost per version is about (1 + (K - 1) * delta fraction) / K of a full one; 1 = never a delta."""
    relay_fanout: int = 0
    """Relays (docs/running.md, "Relays"): with F > 0 each published pointer names, signed, the live
    workers that relay (rollout.relay; by worker id, at most broker.registry.MAX_RELAYS) as a tree of
    degree F (broker.fanout): the first F fetch from the trainer, each other from a relay, so the
    trainer sends about F copies of a version whatever the pool's size. 0 = off: every worker fetches
    from the trainer."""
    collect_timeout_s: float = 300.0
    """Give up waiting for trajectories after this long (seconds)."""
    max_abs_reward: float = 1e3
    """Samples with |reward| above this are refused (trainer.validation)."""

    def __post_init__(self):
        errors = self._batch_errors() + self._optimizer_errors() + self._placement_errors() + self._serving_errors()
        if errors:
            raise ValueError("TrainerConfig: " + "; ".join(errors))

    def _batch_errors(self) -> list[str]:
        """Steps, groups, minibatches, publishing and checkpoints."""
        errors = []
        for name in (
            "max_steps",
            "groups_per_step",
            "group_size",
            "minibatches",
            "publish_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if not is_int(self.mismatch_split_rows, lo=0):
            errors.append(f"mismatch_split_rows={self.mismatch_split_rows!r} (want an int >= 0; 0 = every row)")
        if not is_int(self.microbatch_tokens, lo=0):
            errors.append(f"microbatch_tokens={self.microbatch_tokens!r} (want an int >= 0; 0 = no chunking)")
        if self.checkpoint_every < 0:
            errors.append(f"checkpoint_every={self.checkpoint_every} (must be >= 0; 0 = never)")
        if not 0 <= self.memory_fraction <= 1:
            errors.append(f"memory_fraction={self.memory_fraction} (want 0 < f <= 1, or 0 = no cap)")
        if self.group_size < 2:
            errors.append(f"group_size={self.group_size} (GRPO needs >= 2 samples per prompt)")
        if self.minibatches >= 1 and self.groups_per_step * self.group_size % self.minibatches:
            errors.append(
                f"minibatches={self.minibatches} must divide groups_per_step*group_size="
                f"{self.groups_per_step * self.group_size}"
            )
        return errors

    def _optimizer_errors(self) -> list[str]:
        """Learning rates, clipping, TIS and the backward."""
        errors = []
        if not (self.lr > 0 and self.warmstart_lr > 0):
            errors.append(f"lr={self.lr}, warmstart_lr={self.warmstart_lr} (must be > 0)")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            errors.append(f"clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.tis_cap < 1:
            errors.append(f"tis_cap={self.tis_cap} (must be >= 1)")
        if self.backward not in ("hp", "dequant"):
            errors.append(f"backward={self.backward!r} (hp or dequant)")
        return errors

    def _placement_errors(self) -> list[str]:
        """Device, dtype and backend, evaluation and warm start."""
        errors = []
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda|cuda:\d+", self.device):
            errors.append(f"device={self.device!r} (cpu, cuda or cuda:N)")
        if self.dtype not in ("bfloat16", "float32"):
            errors.append(f"dtype={self.dtype!r} (bfloat16 or float32)")
        if self.backend not in ("torch", "megatron"):
            errors.append(f"backend={self.backend!r} (torch or megatron)")
        elif self.backend == "megatron" and not self.device.startswith("cuda"):
            errors.append(
                f"backend='megatron' needs device='cuda' (got {self.device!r}): its GPTModel runs on CUDA only"
            )
        if self.eval_every < 0 or self.eval_prompts < 1:
            errors.append(f"eval_every={self.eval_every}, eval_prompts={self.eval_prompts} (want >= 0 and >= 1)")
        if self.eval_every and self.backend != "torch":
            errors.append(
                f"eval_every={self.eval_every} needs backend='torch' (it generates with policy.model; 0 = off)"
            )
        if self.warmstart_steps < 0:
            errors.append(f"warmstart_steps={self.warmstart_steps} (must be >= 0)")
        if not is_number(self.warmstart_until, 0, 1):
            errors.append(f"warmstart_until={self.warmstart_until!r} (an accuracy in [0, 1]; 0 = off)")
        elif self.warmstart_until and self.backend != "torch":
            errors.append(
                f"warmstart_until={self.warmstart_until} needs backend='torch' (it generates with policy.model; 0 = off)"
            )
        return errors

    def _serving_errors(self) -> list[str]:
        """The policy server: its address, processes, deltas, deadlines, stream limits; metrics."""
        errors = []
        if self.grpc_advertise:
            host, _, port = self.grpc_advertise.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                errors.append(f"grpc_advertise={self.grpc_advertise!r} (want host:port)")
            elif self.grpc_port == 0:
                errors.append(f"grpc_advertise={self.grpc_advertise!r} needs a fixed grpc_port (it is 0: a free port)")
        if not is_int(self.mps_thread_percentage, 0, 100):
            errors.append(f"mps_thread_percentage={self.mps_thread_percentage!r} (an int in [0, 100]; 0 = no limit)")
        if not is_int(self.mps_client_priority, 0, 1):
            errors.append(f"mps_client_priority={self.mps_client_priority!r} (0 normal or 1 below normal)")
        if self.policy_server_process is not None and not isinstance(self.policy_server_process, bool):
            errors.append(f"policy_server_process={self.policy_server_process!r} (want true, false or null)")
        if not is_int(self.policy_server_processes, 1):
            errors.append(f"policy_server_processes={self.policy_server_processes!r} (an int >= 1)")
        elif self.policy_server_processes > 1 and self.policy_server_process is False:
            errors.append(
                f"policy_server_processes={self.policy_server_processes} with policy_server_process=false "
                "(several serving processes need the server in child processes)"
            )
        if not isinstance(self.policy_deltas, bool):
            errors.append(f"policy_deltas={self.policy_deltas!r} (want true or false)")
        if not is_int(self.delta_full_every, 1):
            errors.append(f"delta_full_every={self.delta_full_every!r} (an int >= 1; 1 = every version full)")
        if not is_int(self.relay_fanout, 0, MAX_FANOUT):
            errors.append(f"relay_fanout={self.relay_fanout!r} (an int in [0, {MAX_FANOUT}]; 0 = no relays)")
        if not self.fetch_deadline_s > 0:
            errors.append(f"fetch_deadline_s={self.fetch_deadline_s} (must be > 0)")
        if not self.stall_s > 0:
            errors.append(f"stall_s={self.stall_s} (must be > 0)")
        for name in ("max_unauthenticated_streams", "max_streams_per_peer"):
            v = getattr(self, name)
            if not is_int(v, 1, 255):
                errors.append(f"{name}={v!r} (an int in [1, 255]: the server serves 256 streams)")
        if not -1 <= self.metrics_port <= 65535:
            errors.append(f"metrics_port={self.metrics_port} (-1 = off, 0 = free, else a port)")
        return errors

    def queued_groups(self, max_staleness: int) -> int:
        """Groups are consumed first in, first out, and the groups being trained on still count as
        queued until their commit, so a group fed now is used about Q / groups_per_step - 1 steps
        later. Q = groups_per_step * max(1, max_staleness) keeps fast rollouts from producing samples
        that are already too stale, and with max_staleness=0 it is the synchronous loop."""
        return self.prompts_ahead or self.groups_per_step * max(1, max_staleness)
