"""Mutation fuzzing of everything that parses untrusted input: 0 unexpected exceptions is the bar.

    python bench/fuzz_inputs.py                      # every target, 10,000 inputs each (CI's size)
    python bench/fuzz_inputs.py --inputs 1000000 --target codec --seed 7

Targets, and the only exceptions each may raise (anything else is a bug, printed with its input):
    codec     broker.codec.decode_trajectory / decode_prompt_group on mutated encodings -> CodecError;
              a prompt group that decodes then through rollout.prompt_check -> nothing (a reason or None)
    manifest  manifest_from_bytes + verify_manifest + policy.manifest_check + rebuild -> ValueError
    chunks    the policy client's chunk acceptance (PolicyClient._accept) on mutated chunks -> ValueError
    config    tandem.config.load with mutated `key=value` overrides -> ValueError
    pointer   broker.registry.parse_pointer + pointer_signed on mutated policy:latest hashes -> nothing

Each input is a valid seed (a real encoding, a real manifest, a real chunk, a real override, a real
signed pointer) with 1-8 random mutations: byte flips, inserts, deletes, truncations, splices of
random bytes, or field swaps. Random, not coverage-guided (atheris is not installed here); the
seeds make the mutations land inside real structure, so most inputs reach deep parsing code.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker import codec  # noqa: E402
from broker.registry import PolicyPointer, _signed_bytes, parse_pointer, pointer_signed  # noqa: E402
from broker.signing import POLICY_POINTER, Signer  # noqa: E402
from policy import manifest as mf
from policy.chunks import first_chunk_indices
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.manifest_check import check_manifest, expected_tensors  # noqa: E402
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.recipe import Recipe  # noqa: E402
from policy.tp_layout import rebuild, tensor_layout, tp_plan_of
from rollout.prompt_check import PromptRules, check_prompt  # noqa: E402
from rollout.tasks import AdditionTask  # noqa: E402
from tandem import config as run_config  # noqa: E402
from tandem.v1 import policy_pb2  # noqa: E402


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(6)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i:i] = bytes([rng.randrange(256)])
        elif op == 2 and b:
            del b[min(i, len(b) - 1)]
        elif op == 3:
            del b[i:]
        elif op == 4:
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 5 and b:
            b[min(i, len(b) - 1)] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xDC, 0xDD, 0xCF])
    return bytes(b)


def _trajectory() -> codec.Trajectory:
    return codec.Trajectory(
        sample_id="p1/0", prompt_id="p1", group_id="p1", sample_index=0, group_size=4,
        prompt_tokens=np.array([1, 4, 5, 3], dtype=np.int32), completion_tokens=np.array([6, 2], dtype=np.int32),
        behavior_logprobs=np.array([-0.5, -0.1], dtype=np.float32), reward=1.0, policy_version=3,
        contract_fingerprint="f" * 64, worker_id="w0", created_at=1.0, info={"finish": "eos"},
    )  # fmt: skip


def target_codec() -> Callable[[random.Random], None]:
    seeds = [
        (codec.encode_trajectory(_trajectory()), codec.decode_trajectory),
        (
            codec.encode_prompt_group(
                codec.PromptGroup(
                    prompt_id="p1",
                    group_id="p1",
                    prompt_tokens=np.array([1, 2], np.int32),
                    n_samples=4,
                    task={"answer": "3"},
                )  # fmt: skip
            ),
            codec.decode_prompt_group,
        ),
    ]

    rules = PromptRules(vocab_size=15, max_seq_len=64, max_new_tokens=3, max_batch=8, group_size=4)

    def one(rng: random.Random) -> None:
        data, decode = rng.choice(seeds)
        try:
            got = decode(mutate(rng, data))
        except codec.CodecError:
            return
        if isinstance(got, codec.PromptGroup):  # what a worker does next with it: never raises
            check_prompt(got, rules, check_fields=AdditionTask.check_fields)

    return one


def _policy():
    cfg = ModelConfig.preset("tiny", n_layers=4, n_experts=2, top_k=1)  # layers 0-2 nvfp4, 3 bf16
    recipe = Recipe.load("nvfp4_moe")
    plan = recipe.plan(cfg)
    tensors = quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), plan)
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    packed = mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors, chunk_bytes=4096)
    return plan, packed


def target_manifest() -> Callable[[random.Random], None]:
    plan, packed = _policy()
    expected = expected_tensors(plan)
    data = mf.manifest_to_bytes(packed.manifest)

    def one(rng: random.Random) -> None:
        try:
            m = mf.manifest_from_bytes(mutate(rng, data))
            check_manifest(m, expected, max_total_bytes=1 << 30)  # verify_manifest included
            plan_ = tp_plan_of(m)
            for t in m.tensors:
                layout = tensor_layout(t, plan_)
                blob = packed.blobs.get(t.name, b"")
                rebuild(t, layout, bytearray(blob) if len(blob) == layout.nbytes else bytearray(layout.nbytes))
        except ValueError:
            pass

    return one


def target_chunks() -> Callable[[random.Random], None]:
    from broker.policy_client import PolicyClient, _Tensor

    _, packed = _policy()
    m = packed.manifest
    plan = tp_plan_of(m)
    first = first_chunk_indices(m)
    entries = {t.name: t for t in m.tensors}
    name = max(entries, key=lambda n: entries[n].nbytes)
    blob = packed.blobs[name]
    chunk = policy_pb2.TensorChunk(
        version=1, tensor_name=name, chunk_index=first[name], tensor_nbytes=len(blob), offset=0,
        data=bytes(blob[: m.chunk_bytes]), xxh3=entries[name].chunk_xxh3[0],
    )  # fmt: skip
    raw = chunk.SerializeToString()
    hasher = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def one(rng: random.Random) -> None:
        state = {name: _Tensor(tensor_layout(entries[name], plan), entries[name], first[name], m.chunk_bytes)}
        try:
            c = policy_pb2.TensorChunk.FromString(mutate(rng, raw))
        except Exception:  # protobuf's DecodeError: the transport would refuse it
            return
        try:
            PolicyClient._accept(c, state, m, first[name], hasher)
        except ValueError:
            pass

    return one


def target_config() -> Callable[[random.Random], None]:
    seeds = [
        b"trainer.max_steps=20", b"model.overrides={n_layers: 2, dim: 64}", b"loop.max_staleness=1",
        b"rollout.tls.ca=/x", b"trainer.betas=[0.9, 0.95]", b"task.digits=2", b"redis_outage_s=5.5",
        b"recipe=bf16", b"trainer.health.port=8080",
    ]  # fmt: skip

    def one(rng: random.Random) -> None:
        text = mutate(rng, rng.choice(seeds)).decode("utf-8", errors="replace")
        try:
            run_config.load(None, [text])
        except ValueError:
            pass

    return one


def target_pointer() -> Callable[[random.Random], None]:
    signer = Signer(b"k" * 32)
    p = PolicyPointer(
        version=7, address="10.0.0.1:50051", contract_fingerprint="f" * 64, published_at=1.5, content_digest="d" * 64,
        fanout=2, relays=(("w0", "10.0.0.2:7000"), ("w1", "10.0.0.3:7000"), ("w2", "10.0.0.4:7000")),
    )  # fmt: skip
    relays = json.dumps([list(r) for r in p.relays], separators=(",", ":"))
    fields = (
        str(p.version), p.address, p.contract_fingerprint, repr(p.published_at), p.content_digest, str(p.fanout), relays
    )  # fmt: skip
    names = (b"version", b"address", b"contract_fingerprint", b"published_at", b"content_digest", b"fanout", b"relays")
    good = {name: f.encode() for name, f in zip(names, fields)}
    good[b"sig"] = signer.sign(POLICY_POINTER, _signed_bytes(*fields)).hex().encode()

    def one(rng: random.Random) -> None:
        h = dict(good)
        for key in rng.sample(list(h), rng.randint(1, 3)):
            if rng.random() < 0.1:
                del h[key]
            else:
                h[key] = mutate(rng, h[key])
        signed, parsed = pointer_signed(h, signer), parse_pointer(h)
        if signed and parsed != p:
            raise AssertionError(f"a mutated pointer verified: {h}")

    return one


TARGETS = {
    "codec": target_codec,
    "manifest": target_manifest,
    "chunks": target_chunks,
    "config": target_config,
    "pointer": target_pointer,
}


def run(name: str, inputs: int, seed: int) -> int:
    """Fuzz one target; returns the number of unexpected exceptions (each printed once per type)."""
    one = TARGETS[name]()
    rng = random.Random(seed)
    bad, seen, t0 = 0, set(), time.perf_counter()
    for i in range(inputs):
        state = rng.getstate()
        try:
            one(rng)
        except Exception as e:
            bad += 1
            if type(e) not in seen:
                seen.add(type(e))
                rng.setstate(state)
                print(f"{name}: input {i} (seed {seed}) raised {type(e).__name__}:", file=sys.stderr)
                traceback.print_exc()
    print(f"{name}: {inputs} inputs, {bad} unexpected exceptions, {time.perf_counter() - t0:.1f}s")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(TARGETS), action="append")
    p.add_argument("--inputs", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return 1 if sum(run(t, args.inputs, args.seed) for t in args.target or TARGETS) else 0


if __name__ == "__main__":
    sys.exit(main())
