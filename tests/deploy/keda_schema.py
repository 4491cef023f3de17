"""Validation of KEDA `ScaledObject`s and `TriggerAuthentication`s (keda.sh/v1alpha1) and of the
redis-streams trigger, offline.

No Python package ships KEDA's CRD schema, so this is written by hand from the structure of
KEDA 2.x's CRD (scaledobjects.keda.sh) for the fields a ScaledObject may carry, with their types,
required fields and enum values, and, for the redis-streams scaler, its documented metadata keys
and rules. Unknown fields are errors, as with a strict Kubernetes schema. Not covered: the HPA
`behavior` block and `scalingModifiers` are accepted as objects without looking inside.
"""

from __future__ import annotations

import re

import jsonschema

_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_STR = {"type": "string"}
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {"name": _NAME, "namespace": _NAME, "labels": _STR_MAP, "annotations": _STR_MAP},
        },
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {"apiVersion": _STR, "kind": _STR, "name": _NAME, "envSourceContainerName": _STR},
                },
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "initialCooldownPeriod": _INT32,
                "idleReplicaCount": _INT32,
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": _INT32,
                        "replicas": _INT32,
                        "behavior": {
                            "enum": ["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]
                        },
                    },
                },
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": _STR, "behavior": {"type": "object"}},
                        },
                        "scalingModifiers": {"type": "object"},
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": _STR,
                            "name": _STR,
                            "metadata": _STR_MAP,
                            "useCachedMetrics": {"type": "boolean"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": _STR,
                                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}

TRIGGER_AUTHENTICATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "TriggerAuthentication"},
        "metadata": SCALED_OBJECT["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                # Only the kinds of reference Tandem uses; others (podIdentity, vaults, ...) are errors here.
                "secretTargetRef": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {"parameter": _STR, "name": _NAME, "key": _STR},
                    },
                },
                "env": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name"],
                        "additionalProperties": False,
                        "properties": {"parameter": _STR, "name": _STR, "containerName": _STR},
                    },
                },
            },
        },
    },
}
# The redis-streams scaler's authentication parameters (from a TriggerAuthentication).
REDIS_AUTH_PARAMETERS = {"username", "password", "tls", "ca", "cert", "key", "keyPassword"}

# The redis-streams scaler's metadata keys (KEDA 2.x docs), all strings.
REDIS_STREAMS_KEYS = {
    "address",
    "addressFromEnv",
    "host",
    "hostFromEnv",
    "port",
    "portFromEnv",
    "username",
    "usernameFromEnv",
    "password",
    "passwordFromEnv",
    "stream",
    "consumerGroup",
    "pendingEntriesCount",
    "streamLength",
    "lagCount",
    "activationLagCount",
    "databaseIndex",
    "enableTLS",
    "unsafeSsl",
}
_COUNT_KEYS = ("pendingEntriesCount", "streamLength", "lagCount", "activationLagCount", "databaseIndex")


def errors(doc: dict) -> list[str]:
    """Every problem with a ScaledObject or TriggerAuthentication, as `path: message` strings (empty
    when valid)."""
    schema = TRIGGER_AUTHENTICATION if doc.get("kind") == "TriggerAuthentication" else SCALED_OBJECT
    out = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(doc)
    ]
    if out or schema is TRIGGER_AUTHENTICATION:
        return out + [
            f"spec.secretTargetRef: unknown redis parameter {r['parameter']!r}"
            for r in doc.get("spec", {}).get("secretTargetRef", [])
            if r["parameter"] not in REDIS_AUTH_PARAMETERS
        ]
    spec = doc["spec"]
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        out.append(f"spec: minReplicaCount {spec['minReplicaCount']} > maxReplicaCount {spec['maxReplicaCount']}")
    for i, trigger in enumerate(spec["triggers"]):
        if trigger["type"] == "redis-streams":
            out += [f"spec.triggers.{i}.metadata: {m}" for m in redis_streams_errors(trigger["metadata"])]
    return out


def redis_streams_errors(md: dict) -> list[str]:
    out = [f"unknown key {k!r}" for k in sorted(set(md) - REDIS_STREAMS_KEYS)]
    if not md.get("stream"):
        out.append("stream is required")
    if not (md.get("address") or md.get("addressFromEnv") or md.get("host") or md.get("hostFromEnv")):
        out.append("address (host:port) or host + port is required")
    if md.get("address") and not re.fullmatch(r"[^:\s]+:\d{1,5}", md["address"]):
        out.append(f"address={md['address']!r} must be host:port")
    if (md.get("host") or md.get("hostFromEnv")) and not (md.get("port") or md.get("portFromEnv")):
        out.append("host needs port")
    for k in _COUNT_KEYS:
        if k in md and not re.fullmatch(r"\d+", md[k]):
            out.append(f"{k}={md[k]!r} must be a non-negative integer string")
    for k in ("enableTLS", "unsafeSsl"):
        if k in md and md[k] not in ("true", "false"):
            out.append(f"{k}={md[k]!r} must be 'true' or 'false'")
    if md.get("unsafeSsl") == "true" and md.get("enableTLS") != "true":
        out.append("unsafeSsl needs enableTLS: 'true'")
    if "lagCount" in md:
        if not md.get("consumerGroup"):
            out.append("lagCount (consumer-group lag) needs consumerGroup")
        if "activationLagCount" not in md:
            out.append("lagCount needs activationLagCount")
        if "pendingEntriesCount" in md or "streamLength" in md:
            out.append("lagCount excludes pendingEntriesCount and streamLength")
    return out
