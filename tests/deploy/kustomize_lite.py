"""A minimal Kustomize renderer for exactly the features deploy/k8s uses, so the manifest tests run
offline with no kustomize binary (none ships in a PyPI/npm package for this Python, and Debian's
kubernetes-client 1.20 embeds a kustomize too old for these files).

Supported: `resources` (files and directories with a kustomization.yaml), `namespace`, `images`
(newName/newTag on containers' `image`), `patches` with `path` (strategic merge, target taken from
the patch's kind + name), `secretGenerator` (envs/literals, with disableNameSuffixHash: true).
Anything else raises ValueError, so a new feature in the manifests cannot be silently ignored.
Where `kubectl kustomize` is installed, test_manifests.py checks this renderer against it.

Strategic merge, simplified: maps merge recursively; lists of maps with a Kubernetes patch merge
key (containers/env/volumes by name, volumeMounts by mountPath, ports by containerPort) merge by
that key, with new items first as kustomize orders them; every other list is replaced; a null value
deletes the key. No `$patch` directives.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches", "secretGenerator"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}


def render(directory: str | Path) -> list[dict]:
    """The resources `kustomize build directory` would print (in no particular order)."""
    directory = Path(directory)
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = sorted(set(k) - SUPPORTED)
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: unsupported kustomize fields {unknown}")
    out: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        out += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("secretGenerator", []):
        out.append(_secret(directory, gen))
    _check_unique(out, directory)
    for patch in k.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path:` is supported, got {patch}")
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            target = _find(out, doc["kind"], doc["metadata"]["name"], directory)
            merged = _merge(target, doc)
            out[out.index(target)] = merged
    if "namespace" in k:
        for d in out:
            if d["kind"] not in CLUSTER_SCOPED:
                d.setdefault("metadata", {})["namespace"] = k["namespace"]
    for image in k.get("images", []):
        if set(image) - {"name", "newName", "newTag"}:
            raise ValueError(f"{directory}: images supports name/newName/newTag, got {image}")
        for d in out:
            _set_images(d, image)
    return out


def _secret(directory: Path, gen: dict) -> dict:
    if set(gen) - {"name", "envs", "literals", "type", "options"}:
        raise ValueError(f"{directory}: unsupported secretGenerator fields in {gen}")
    if gen.get("options") != {"disableNameSuffixHash": True}:
        raise ValueError(
            f"{directory}: secretGenerator {gen['name']} needs options.disableNameSuffixHash: true "
            "(name suffixes would need reference rewriting, which this renderer does not do)"
        )
    pairs = list(gen.get("literals", []))
    for env in gen.get("envs", []):
        pairs += [ln for ln in (directory / env).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    data = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{directory}: secretGenerator {gen['name']}: {pair!r} is not KEY=VALUE")
        data[key.strip()] = base64.b64encode(value.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": gen["name"]},
        "type": gen.get("type", "Opaque"),
        "data": data,
    }


def _check_unique(docs: list[dict], directory: Path) -> None:
    seen = set()
    for d in docs:
        key = (d["kind"], d["metadata"]["name"])
        if key in seen:
            raise ValueError(f"{directory}: {key} defined twice")
        seen.add(key)


def _find(docs: list[dict], kind: str, name: str, directory: Path) -> dict:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise ValueError(f"{directory}: a patch targets {kind}/{name}, which is not among the resources")


def _merge(base, patch, key: str | None = None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = _merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    merge_key = MERGE_KEYS.get(key)
    if merge_key and isinstance(base, list) and isinstance(patch, list):
        index = {item[merge_key]: i for i, item in enumerate(base)}
        merged = copy.deepcopy(base)
        new = []
        for item in patch:
            if item[merge_key] in index:
                i = index[item[merge_key]]
                merged[i] = _merge(merged[i], item)
            else:
                new.append(copy.deepcopy(item))
        return new + merged
    return copy.deepcopy(patch)


def _set_images(node, image: dict) -> None:
    if isinstance(node, dict):
        for field in ("containers", "initContainers"):
            for c in node.get(field) or [] if isinstance(node.get(field), list) else []:
                ref = c.get("image", "")
                name, tag = ref.rsplit(":", 1) if ":" in ref.split("/")[-1] else (ref, None)
                if name == image["name"]:
                    tag = image.get("newTag", tag)
                    c["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
        for v in node.values():
            _set_images(v, image)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, image)
