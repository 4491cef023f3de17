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
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from broker import frames
from broker.registry import PolicyPointer, PolicyRegistry
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
        log: Callable[[str], None] = print,
    ):
        """server: a broker PolicyServer or ServingProcesses; advertise: the address named in
        policy:latest (None: the server's own); keep_digests: versions whose digest is kept."""
        self.backend, self.contracts, self.versions = backend, contracts, versions
        self.server, self.buffers, self.device = server, buffers, device
        self.advertise, self.keep_digests = advertise, keep_digests
        self.publisher = Publisher(log=log)
        self.registry: PolicyRegistry | None = None
        self._digests: dict[int, str] = {}  # version -> its manifest's digest (hex), named in policy:latest
        self.quantize_s = 0.0  # the last publish's production of the quantized parts (training thread)
        self.background_s = 0.0  # the background part of the last publish that finished

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

    async def point_registry(self, version: int | None = None) -> None:
        """Point policy:latest at `version` (default: the newest version the server holds; none yet: nothing)."""
        version = version or max(self.server.versions(), default=0)
        if not version:
            return
        await self.registry.publish(
            PolicyPointer(
                version=version,
                address=self.advertise or self.server.address,
                contract_fingerprint=self.contracts.accepted,
                published_at=time.time(),
                content_digest=self._digests[version],  # what workers trust, whoever serves the bytes
            )
        )

    async def idle(self) -> float:
        return await self.publisher.idle()

    async def close(self) -> None:
        """Let the publish in flight finish (its failure is logged, not raised: on the way out after an
        error), then stop the server and free the buffers its thread writes into."""
        await self.publisher.settle()
        self.server.stop()
        self.buffers.close()
