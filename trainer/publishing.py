"""Publishing a policy version: quantize, retain, frame, serve, then point policy:latest at it.

    pub.start(registry)                 the policy server up; policy:latest written through `registry`
    blocked_s = await pub.publish(v, announced=callback)
    await pub.idle()                    the publish in flight done (or its failure raised)

On the training thread (`publish`): wait for the previous publish (back-pressure, `blocked_s`),
queue the NaN/Inf check of the master weights, produce the quantized parts (the QAT cache refill,
which the next forward needs anyway: `quantize_s`) and retain them (trainer.versions). In the
background (trainer.publisher, `publish_bg_s`): the check's result (a failure is raised by the next
publish and the version is never served), framing, hashing and installing in the server; then
policy:latest names the version, once it is servable, and `announced()` runs. Parts sharing
storage with a live parameter are staged on the training thread instead, before the next update.
With the rollout_recipe ablation the published tensors are quantized by the rollouts' recipe.
With `relay_fanout` F > 0 the pointer also names, signed, the live workers' relays (`relay_tree`):
the tree of degree F a version travels over (broker.fanout).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from broker import frames
from broker.registry import MAX_RELAYS, Heartbeats, PolicyPointer, PolicyRegistry
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import ModelConfig
from policy.recipe import Plan, Recipe

from .publisher import Publisher
from .versions import RetainedVersions, aliasing


@dataclass(frozen=True, kw_only=True)
class Contracts:
    """The contract the trainer trains under and the one it publishes and accepts (the same one
    unless the rollout_recipe ablation names another recipe)."""

    recipe: Recipe
    rollout_recipe: Recipe
    fingerprint: str  # of the training contract: checkpoints carry it
    accepted: str  # of the published contract: accepted from the rollouts' trajectories
    publish_contract: mf.Contract
    publish_plan: Plan

    @classmethod
    def of(cls, model_config: ModelConfig, recipe: Recipe, rollout_recipe: Recipe | None = None) -> Contracts:
        rollout_recipe = rollout_recipe or recipe
        published = contract_from_recipe(model_config=model_config, recipe=rollout_recipe)
        return cls(
            recipe=recipe,
            rollout_recipe=rollout_recipe,
            fingerprint=contract_from_recipe(model_config=model_config, recipe=recipe).fingerprint(),
            accepted=published.fingerprint(),
            publish_contract=published,
            publish_plan=rollout_recipe.plan(model_config),
        )

    @property
    def breaking(self) -> bool:
        return self.accepted != self.fingerprint


class PolicyPublishing:
    def __init__(
        self,
        backend,
        contracts: Contracts,
        versions: RetainedVersions,
        server,
        buffers: frames.BufferPool,
        *,
        advertise: str | None,
        keep_digests: int,
        device: torch.device,
        relay_fanout: int = 0,
        log: Callable[[str], None] = print,
    ):
        """server: a broker PolicyServer or ServingProcesses; advertise: the address named in
        policy:latest (None: the server's own); keep_digests: versions whose digest is kept;
        relay_fanout: the degree of the relay tree (trainer.relay_fanout; 0: none)."""
        self.backend, self.contracts, self.versions = backend, contracts, versions
        self.server, self.buffers, self.device = server, buffers, device
        self.advertise, self.keep_digests, self.relay_fanout = advertise, keep_digests, relay_fanout
        self.log = log
        self.relays_named = 0  # members of the last pointer's relay tree
        self.publisher = Publisher(log=log)
        self.registry: PolicyRegistry | None = None
        self._digests: dict[int, str] = {}  # version -> its manifest's digest (hex), named in policy:latest
        self.quantize_s = 0.0  # the last publish's production of the quantized parts (training thread)
        self.background_s = 0.0  # the background part of the last publish that finished
        # The serving processes' bytes sent, as of the last publish: read in the publisher's thread,
        # never on the training thread (a stalled serving child must not hold up a step's row).
        self.sent_bytes = 0

    def start(self, registry: PolicyRegistry) -> None:
        self.registry = registry
        self.server.start()

    async def publish(self, version: int, *, announced: Callable[[], None]) -> float:
        """Start publishing `version` (module doc); the seconds waited for the previous publish."""
        blocked = await self.publisher.idle()  # one publish in flight; raises if the previous one failed
        if self.backend.qat_hook is None:
            self.backend.apply_qat()
        t0 = time.perf_counter()
        check = self.backend.finite_check()  # queued on the device; read in the thread
        retained = self.backend.quantized_params(check_finite=False)  # the QAT forward's own quantized parts
        if self.contracts.breaking:
            tensors = quantize_params(self.backend.canonical(), self.contracts.publish_plan)
        else:
            tensors = retained
        self.quantize_s = time.perf_counter() - t0
        live = list(self.backend.parameters())
        self.versions.add(version, retained, live=live)
        stage = functools.partial(
            frames.stage,
            version=version,
            parent_version=version - 1 if version > 1 else None,
            contract=self.contracts.publish_contract,
            tensors=tensors,
            pool=self.buffers,
        )
        staged = stage(live=live) if aliasing(tensors, live) else None

        def prepare() -> None:
            t = time.perf_counter()
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                check()
                self._serve((staged or stage()).run(), version)
            self.background_s = time.perf_counter() - t

        async def announce() -> None:
            await self.point_registry(version)
            announced()

        self.publisher.start(version, prepare, announce)
        return blocked

    def _serve(self, framed, version: int) -> None:
        self._digests = {k: d for k, d in self._digests.items() if k > version - self.keep_digests}
        self._digests[version] = mf.manifest_digest(framed.manifest).hex()
        self.server.publish(framed)
        self.sent_bytes = self.server.stats()["bytes_sent"]

    async def point_registry(self, version: int | None = None) -> None:
        """Point policy:latest at `version` (default: the newest version the server holds; none yet: nothing)."""
        version = version or max(self.server.versions(), default=0)
        if not version:
            return
        relays = await self.relay_tree() if self.relay_fanout else ()
        if len(relays) != self.relays_named:
            self.log(f"v{version}: {len(relays)} relay(s) in the fan-out tree of degree {self.relay_fanout}")
        self.relays_named = len(relays)
        await self.registry.publish(
            PolicyPointer(
                version=version,
                address=self.advertise or self.server.address,
                contract_fingerprint=self.contracts.accepted,
                published_at=time.time(),
                content_digest=self._digests[version],  # what workers trust, whoever serves the bytes
                fanout=self.relay_fanout,
                relays=relays,
            )
        )

    async def relay_tree(self) -> tuple[tuple[str, str], ...]:
        """The live rollout workers that relay, (worker id, relay address) by worker id, at most
        MAX_RELAYS: from their heartbeats, which anybody with access to Redis can write. A rogue
        address here can only make a worker ask the wrong server first: the pointer signs the
        version's content digest, so bytes from anywhere else fail verification, that relay is
        passed over and the worker falls back to its next source (rollout/sources.py). Entries that
        are not a (1-256 character, whitespace-free) id and host:port are left out."""
        beats = await Heartbeats(self.registry.redis, self.registry.keys).live("rollout")
        tree = []
        for worker_id, beat in sorted(beats.items()):
            address = (beat.get("info") or {}).get("relay") if isinstance(beat, dict) else None
            if _relay_entry_ok(worker_id) and _relay_entry_ok(address) and ":" in address:
                tree.append((worker_id, address))
        return tuple(tree[:MAX_RELAYS])

    async def idle(self) -> float:
        return await self.publisher.idle()

    async def close(self) -> None:
        """Let the publish in flight finish (its failure is logged, not raised: on the way out after an
        error), then stop the server and free the buffers its thread writes into."""
        await self.publisher.settle()
        self.server.stop()
        self.buffers.close()


def _relay_entry_ok(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 256 and not any(c.isspace() for c in value)
