"""`tandem export (RUN_DIR | HOST:PORT) [--version V] --format FMT --out DIR`: a published version as a
Hugging Face folder for transformers / vLLM / SGLang (formats: policy/export.py).

RUN_DIR: a run folder (`tandem run`); version V is re-quantized from the master weights of the
checkpoint that holds that version (trainer.keep_checkpoints are kept), which gives the published
bytes exactly (the quantizers are pure functions of the weights). The run's tokenizer is written
beside the weights (its `save_pretrained`: tokenizer.json, tokenizer_config.json) with its
bos/eos/pad ids in config.json and generation_config.json. HOST:PORT: a trainer's policy server;
the version's packed tensors are fetched and verified like a rollout worker does (no tokenizer: a
server does not know the run's task). Default version: the newest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policy.export import EXPORT_FORMATS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="run folder, or host:port of a trainer's policy server")
    p.add_argument("--version", type=int, default=None, help="policy version (default: the newest)")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="output format")
    p.add_argument("--out", required=True, help="output folder (created; must be empty if it exists)")
    p.add_argument("--timeout", type=float, default=600.0, help="server fetch deadline, seconds")
    p.add_argument("--tls-ca", default=None, help="CA certificate: connect with TLS")
    p.add_argument("--tls-cert", default=None, help="client certificate (mTLS)")
    p.add_argument("--tls-key", default=None, help="client private key (mTLS)")
    p.add_argument(
        "--run-secret-file",
        default="",
        help="the run's secret (a tandem run's run.secret; default $TANDEM_RUN_SECRET): sends the run token "
        "that a trainer with a run secret requires",
    )


def from_run_dir(run_dir: Path, version: int | None):
    """(model config, {name: quantized}, recipe name, fingerprint, version, tokenizer) from a run folder."""
    from policy.contract import contract_from_recipe
    from policy.formats.params import quantize_params
    from tandem import config as run_config
    from tandem.services import task_and_model
    from trainer.checkpoints import checkpoint_of_version

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ValueError(f"{run_dir} is not a run folder (needs config.yaml and checkpoints/)")
    task, model_config, recipe = task_and_model(run_config.load(cfg_file))
    fingerprint = contract_from_recipe(model_config=model_config, recipe=recipe).fingerprint()
    ckpt, ck = checkpoint_of_version(run_dir / "checkpoints", version)
    if ck["fingerprint"] != fingerprint:
        raise ValueError(f"{ckpt} has contract {ck['fingerprint'][:12]}, the run's config gives {fingerprint[:12]}")
    version = ck["weights_version"]
    plan = recipe.plan(model_config)
    names = {e.name for e in plan.params}
    weights = {n: w for n, w in ck["model"].items() if n in names}  # parameters, not buffers
    packed = quantize_params(weights, plan)
    return model_config, {n: q.value for n, q in packed.items()}, recipe.name, fingerprint, version, task.tokenizer


def from_server(args):
    from broker.policy_client import PolicyClient, PolicyClientConfig
    from broker.signing import load_signer, policy_token
    from broker.tls import ClientTLS
    from policy.model import ModelConfig

    tls = ClientTLS(ca=args.tls_ca or "", cert=args.tls_cert or "", key=args.tls_key or "")
    token = policy_token(load_signer(args.run_secret_file))
    config = PolicyClientConfig(address=args.source, fetch_timeout_s=args.timeout, tls=tls, run_token=token)
    with PolicyClient(config) as client:
        policy = client.fetch(args.version)
    m = policy.manifest
    model_config = ModelConfig.from_dict(json.loads(m.contract.model_config_json))
    return model_config, policy.tensors, m.contract.recipe_name, m.contract_fingerprint, m.version, None


def token_ids(tokenizer) -> dict[str, int]:
    """config.json's bos/eos/pad_token_id of a task tokenizer (a missing bos left out)."""
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {k: int(v) for k, v in ids.items() if v is not None}


def write_tokenizer(tokenizer, out: Path) -> str:
    """Save the run's tokenizer into the export; what the summary line says about it."""
    if tokenizer is None:
        return "no tokenizer (a policy server does not know the run's task: export the run folder for one)"
    save = getattr(tokenizer, "save_pretrained", None)
    if save is None:
        return f"no tokenizer (the task's {type(tokenizer).__name__} has no save_pretrained)"
    names = save(out)  # a user's tokenizer may return nothing
    return "tokenizer " + (", ".join(map(str, names)) if names else f"written by {type(tokenizer).__name__}")


def main(args) -> int:
    import grpc

    from policy.export import export_policy

    out = Path(args.out)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {out} exists and is not an empty folder")
        source = Path(args.source)
        if source.is_dir():
            cfg, tensors, recipe, fingerprint, version, tokenizer = from_run_dir(source, args.version)
        elif ":" in args.source:
            cfg, tensors, recipe, fingerprint, version, tokenizer = from_server(args)
        else:
            raise ValueError(f"{args.source!r} is neither a run folder nor a host:port address")
        ids = token_ids(tokenizer) if tokenizer is not None else None
        summary = export_policy(
            out, cfg, tensors, args.format, recipe=recipe, fingerprint=fingerprint, version=version, token_ids=ids
        )
        tokenizer_note = write_tokenizer(tokenizer, out)
    except (ValueError, OSError, KeyError) as e:
        print(f"tandem export: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"tandem export: {args.source}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    print(
        f"exported version {version} ({recipe}, contract {fingerprint[:12]}) as {args.format} to {out}: "
        f"{summary['quantized']} quantized tensors, {summary['bf16']} bf16; {tokenizer_note}"
    )
    return 0
