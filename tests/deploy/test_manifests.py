"""deploy/: every rendered manifest of both overlays against the Kubernetes schemas
(kubernetes-validate, offline, strict: unknown fields are errors) and KEDA's ScaledObject schema
(keda_schema.py, by hand), then the cross-references a person gets wrong: ports and probes against
what the code listens on, env names against what the code reads, Secret and ConfigMap keys, labels
against selectors, the KEDA trigger against broker/keys.py, the run config against tandem.config.

Rendering: kustomize_lite.py; where `kubectl` is installed, its output is compared with
`kubectl kustomize` (the real Kustomize) object for object.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import keda_schema
import kubernetes_validate
import kustomize_lite
import pytest
import yaml

from broker.health import ROLLOUT_HEALTH, TRAINER_HEALTH
from broker.keys import PROMPTS_GROUP, Keys
from broker.tls import ServerTLS
from tandem import config as run_config
from tandem import env_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.33.0"  # the schemas validated against (kubernetes-validate bundles 1.25 ... 1.37)
TEST_PASSWORD = "test-only-password"
# Secrets the cluster provides (cert-manager or kubectl create secret tls), named in deploy/README.md.
EXTERNAL_TLS_SECRETS = {"tandem-trainer-tls", "tandem-rollout-tls", "tandem-redis-tls", "tandem-redis-client-tls"}
TLS_KEYS = {"tls.crt", "tls.key", "ca.crt"}
NAMESPACE = "tandem"


def _tree(tmp_path_factory) -> Path:
    """deploy/k8s copied, with the Redis password file that deploy/README.md step 1 creates."""
    tree = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("redis.env"))
    (tree / "base" / "redis.env").write_text(f"password={TEST_PASSWORD}\n")
    return tree


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _tree(tmp_path_factory)


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    return {o: kustomize_lite.render(tree / "overlays" / o) for o in OVERLAYS}


# ---------------------------------------------------------------------------------------- helpers
def get(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
    return found[0]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def port_of(c: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are used: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(w: dict) -> dict:
    return w["spec"]["template"]["metadata"]["labels"]


def run_yaml(docs) -> str:
    return get(docs, "ConfigMap", "tandem-config")["data"]["run.yaml"]


def resolve_env(docs, c: dict) -> dict[str, str]:
    """The environment a container gets: literal values and ConfigMap/Secret keys resolved."""
    out = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "configMapKeyRef" in ref:
            cm = ref["configMapKeyRef"]
            out[e["name"]] = get(docs, "ConfigMap", cm["name"])["data"][cm["key"]]
        elif "secretKeyRef" in ref:
            data = get(docs, "Secret", ref["secretKeyRef"]["name"])["data"]
            out[e["name"]] = base64.b64decode(data[ref["secretKeyRef"]["key"]]).decode()
    return out


def loaded_config(docs, tmp_path: Path, workload: str):
    """tandem.config.load of the ConfigMap's run.yaml with the env overrides that pod gets."""
    path = tmp_path / "run.yaml"
    path.write_text(run_yaml(docs))
    w = get(docs, "StatefulSet" if workload == "tandem-trainer" else "Deployment", workload)
    return run_config.load(path, env_config.env_overrides(resolve_env(docs, container(w))))


# ---------------------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_is_valid(rendered, overlay):
    docs = rendered[overlay]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Secret",
            "Service",
            "Service",
            "StatefulSet",
            "StatefulSet",
            "Deployment",
            "ScaledObject",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "NetworkPolicy",
            "NetworkPolicy",
            *(["TriggerAuthentication"] if overlay == "gpu" else []),  # KEDA's Redis client certificate
        ]
    )
    problems = []
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        if d["apiVersion"].startswith("keda.sh/"):
            problems += [f"{where}: {e}" for e in keda_schema.errors(d)]
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        assert d["metadata"].get("namespace") == NAMESPACE, where
    assert not problems, "\n".join(problems)


def test_the_validators_catch_typical_mistakes(rendered):
    """Both validators can fail: a misspelled field, a wrong type, KEDA trigger rules."""
    rollout = get(rendered["cpu"], "Deployment", "tandem-rollout")
    bad = yaml.safe_load(yaml.safe_dump(rollout))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 8081}}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(rollout))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "health"  # must be int
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)

    so = get(rendered["cpu"], "ScaledObject", "tandem-rollout")
    assert keda_schema.errors(so) == []
    bad = yaml.safe_load(yaml.safe_dump(so))
    md = bad["spec"]["triggers"][0]["metadata"]
    del md["activationLagCount"], md["consumerGroup"]
    md["lagCount"] = 2  # not a string
    bad["spec"]["minReplicaCount"] = "0"
    bad["spec"]["scaleTargetRef"]["nmae"] = "x"
    errs = "\n".join(keda_schema.errors(bad))
    assert "'0' is not of type 'integer'" in errs and "'nmae' was unexpected" in errs and "2 is not of type" in errs
    md["lagCount"], bad["spec"]["minReplicaCount"] = "2", 0
    del bad["spec"]["scaleTargetRef"]["nmae"]
    errs = "\n".join(keda_schema.errors(bad))
    assert "needs consumerGroup" in errs and "needs activationLagCount" in errs

    auth = get(rendered["gpu"], "TriggerAuthentication", "tandem-redis-tls")
    assert keda_schema.errors(auth) == []
    bad = yaml.safe_load(yaml.safe_dump(auth))
    bad["spec"]["secretTargetRef"][0]["parameter"] = "cafile"
    del bad["spec"]["secretTargetRef"][1]["key"]
    errs = "\n".join(keda_schema.errors(bad))
    assert "'key' is a required property" in errs
    del bad["spec"]["secretTargetRef"][1]
    assert keda_schema.errors(bad) == ["spec.secretTargetRef: unknown redis parameter 'cafile'"]


# ---------------------------------------------------------------------------------------- wiring
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_probes_match_what_the_code_listens_on(rendered, overlay, tmp_path):
    docs = rendered[overlay]
    cfg = loaded_config(docs, tmp_path, "tandem-trainer").trainer
    trainer = get(docs, "StatefulSet", "tandem-trainer")
    c = container(trainer)
    assert cfg.grpc_host == "0.0.0.0", "a pod must bind all interfaces"
    assert port_of(c, "grpc") == cfg.grpc_port and port_of(c, "health") == cfg.health.port
    assert port_of(c, "metrics") == cfg.metrics_port
    assert trainer["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(cfg.metrics_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": cfg.health.port, "service": TRAINER_HEALTH}, probe

    # The advertised address is the Service, and the Service reaches the gRPC port.
    svc = get(docs, "Service", "tandem-trainer")
    host, port = cfg.grpc_advertise.rsplit(":", 1)
    assert host in (
        svc["metadata"]["name"],
        f"{svc['metadata']['name']}.{NAMESPACE}.svc",
        f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local",
    )
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    assert grpc_port["targetPort"] == "grpc"
    (metrics_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "metrics"]
    assert metrics_port["targetPort"] == "metrics"
    assert trainer["spec"]["serviceName"] == svc["metadata"]["name"]

    rcfg = loaded_config(docs, tmp_path, "tandem-rollout").rollout
    r = container(get(docs, "Deployment", "tandem-rollout"))
    assert port_of(r, "health") == rcfg.health.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert r[probe]["grpc"] == {"port": rcfg.health.port, "service": ROLLOUT_HEALTH}, probe
    # A drain (NOT_SERVING) must not be killed by the liveness probe before the grace period ends.
    live = r["livenessProbe"]
    assert (
        live["periodSeconds"] * live["failureThreshold"]
        >= get(docs, "Deployment", "tandem-rollout")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )

    # Relays: the container port, the pod IP advertised to peers, the trainer naming them in its pointer.
    assert rcfg.relay and rcfg.relay_host == "0.0.0.0" and port_of(r, "relay") == rcfg.relay_port > 0
    env, names = env_of(r), [e["name"] for e in r["env"]]
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["TANDEM_ROLLOUT_RELAY_ADVERTISE"]["value"] == f"$(POD_IP):{rcfg.relay_port}"
    assert names.index("POD_IP") < names.index("TANDEM_ROLLOUT_RELAY_ADVERTISE"), "$(VAR) expands earlier vars only"
    assert rcfg.relay_advertise == f"$(POD_IP):{rcfg.relay_port}" and cfg.relay_fanout > 0
    # Rollout pods take peers on the relay port only, Prometheus on the metrics port.
    by_port = {p["port"]: rule["from"] for rule in get(docs, "NetworkPolicy", "tandem-rollout")["spec"]["ingress"]
               for p in rule["ports"]}  # fmt: skip
    assert set(by_port) == {rcfg.relay_port, rcfg.metrics_port}
    (peers,) = by_port[rcfg.relay_port]
    assert set(peers) == {"podSelector"} and peers["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "rollout"
    )
    (monitoring,) = by_port[rcfg.metrics_port]
    assert monitoring["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}

    # The network policy opens exactly the gRPC port to rollout pods, the metrics port to monitoring.
    np = get(docs, "NetworkPolicy", "tandem-trainer")
    ports = {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]}
    assert ports == {cfg.grpc_port, cfg.metrics_port}
    redis = container(get(docs, "StatefulSet", "tandem-redis"))
    np_redis = get(docs, "NetworkPolicy", "tandem-redis")
    assert {p["port"] for rule in np_redis["spec"]["ingress"] for p in rule["ports"]} == {port_of(redis, "redis")}
    for w in workloads(docs):
        for e in container(w).get("env", []):
            ref = e.get("valueFrom", {}).get("resourceFieldRef")
            if ref:
                assert ref["containerName"] == container(w)["name"], (w["metadata"]["name"], e)


def _code_env_names() -> set[str]:
    """The TANDEM_* variables the code reads: the commands' os.environ reads and tandem.config's table."""
    names = set(env_config.ENV_KEYS) | set(env_config.REDIS_URL_PARTS)
    pattern = re.compile(r"environ(?:\.get\(|\[)\s*\"(TANDEM_[A-Z0-9_]+)\"")
    for path in [*(REPO / "tandem" / "commands").glob("*.py"), REPO / "tandem" / "config.py"]:
        names |= set(pattern.findall(path.read_text()))
    return names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_names_are_the_ones_the_code_reads(rendered, overlay):
    docs = rendered[overlay]
    code = _code_env_names()
    assert {"TANDEM_CONFIG", "TANDEM_RUN_DIR", "TANDEM_WORKER_ID", "TANDEM_REDIS_URL"} <= code  # the scan works
    for w in workloads(docs):
        for name in env_of(container(w)):
            if name.startswith("TANDEM_"):
                assert name in code, f"{w['metadata']['name']}: env {name} is read by no code"

    trainer = container(get(docs, "StatefulSet", "tandem-trainer"))
    rollout = container(get(docs, "Deployment", "tandem-rollout"))
    required = {"TANDEM_CONFIG", "TANDEM_REDIS_URL", "TANDEM_REDIS_PASSWORD"}
    assert required | {"TANDEM_RUN_DIR"} <= set(env_of(trainer))
    assert required | {"TANDEM_WORKER_ID"} <= set(env_of(rollout))
    assert env_of(rollout)["TANDEM_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}

    # TANDEM_CONFIG is the run.yaml of the mounted ConfigMap; TANDEM_RUN_DIR is on the claimed volume.
    trainer_w = get(docs, "StatefulSet", "tandem-trainer")
    for w, c in ((trainer_w, trainer), (get(docs, "Deployment", "tandem-rollout"), rollout)):
        assert _file_behind(w, c, env_of(c)["TANDEM_CONFIG"]["value"]) == ("configMap", "tandem-config", "run.yaml")
    claims = {t["metadata"]["name"] for t in trainer_w["spec"]["volumeClaimTemplates"]}
    run_dir = env_of(trainer)["TANDEM_RUN_DIR"]["value"]
    assert any(run_dir.startswith(m["mountPath"] + "/") and m["name"] in claims for m in trainer["volumeMounts"])

    # KEDA reads the password from the scale target's environment.
    so = get(docs, "ScaledObject", "tandem-rollout")
    assert so["spec"]["triggers"][0]["metadata"]["passwordFromEnv"] in env_of(rollout)
    # The Redis container uses the password variable it defines.
    redis = container(get(docs, "StatefulSet", "tandem-redis"))
    assert "REDIS_PASSWORD" in env_of(redis) and '"$REDIS_PASSWORD"' in " ".join(redis["args"])


def _file_behind(w: dict, c: dict, path: str) -> tuple[str, str, str]:
    """(volume kind, object name, key) of the file a container sees at `path`."""
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
    for m in c["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            rel = path[len(m["mountPath"].rstrip("/")) + 1 :]
            v = volumes[m["name"]]
            for kind, name_field in (("configMap", "name"), ("secret", "secretName")):
                if kind in v:
                    items = v[kind].get("items")
                    keys = {i["path"]: i["key"] for i in items} if items else None
                    key = keys.get(rel) if keys is not None else rel
                    assert key is not None, f"{path}: no item {rel} in volume {m['name']}"
                    return kind, v[kind][name_field], key
    raise AssertionError(f"{path} is on no mounted ConfigMap or Secret")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secret_and_configmap_keys_exist(rendered, overlay):
    docs = rendered[overlay]
    readme = (REPO / "deploy" / "README.md").read_text()

    def keys(kind: str, name: str) -> set[str]:
        if kind == "Secret" and name in EXTERNAL_TLS_SECRETS:
            assert name in readme, f"external Secret {name} is not documented in deploy/README.md"
            return TLS_KEYS
        obj = get(docs, kind, name)
        return set(obj.get("data", {})) | set(obj.get("stringData", {}))

    for w in workloads(docs):
        c, spec = container(w), w["spec"]["template"]["spec"]
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if field in ref:
                    assert ref[field]["key"] in keys(kind, ref[field]["name"]), (w["metadata"]["name"], e)
            if e.get("value", "").startswith("/") and e["name"] not in ("TANDEM_RUN_DIR",):
                kind, name, key = _file_behind(w, c, e["value"])  # a file path: on a mounted object
                assert key in keys("ConfigMap" if kind == "configMap" else "Secret", name), (e, kind, name)
        for v in spec.get("volumes", []):
            if "configMap" in v:
                for item in v["configMap"].get("items", []):
                    assert item["key"] in keys("ConfigMap", v["configMap"]["name"])
            if "secret" in v:
                keys("Secret", v["secret"]["secretName"])
        mounted = {m["name"] for m in c.get("volumeMounts", [])}
        declared = {v["name"] for v in spec.get("volumes", [])} | {
            t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])
        }
        assert mounted <= declared and mounted >= {v["name"] for v in spec.get("volumes", [])}, w["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_labels_match_selectors(rendered, overlay):
    docs = rendered[overlay]
    ws = workloads(docs)
    for w in ws:
        assert matches(w["spec"]["selector"], pod_labels(w)), w["metadata"]["name"]
        others = [o for o in ws if o is not w]
        assert not any(matches(w["spec"]["selector"], pod_labels(o)) for o in others), "selectors overlap"

    def selected(selector: dict) -> list[str]:
        return [w["metadata"]["name"] for w in ws if matches(selector, pod_labels(w))]

    for svc in [d for d in docs if d["kind"] == "Service"]:
        (target,) = selected({"matchLabels": svc["spec"]["selector"]})
        assert target == svc["metadata"]["name"]
        for p in svc["spec"]["ports"]:  # named target ports exist on the selected pods
            port_of(container(get(docs, "StatefulSet", target)), p["targetPort"])
    for pdb in [d for d in docs if d["kind"] == "PodDisruptionBudget"]:
        assert selected(pdb["spec"]["selector"]) == [pdb["metadata"]["name"]]
    for np in [d for d in docs if d["kind"] == "NetworkPolicy"]:
        assert selected(np["spec"]["podSelector"]) == [np["metadata"]["name"]]
    trainer_np = get(docs, "NetworkPolicy", "tandem-trainer")
    (from_pods,) = [f["podSelector"] for f in trainer_np["spec"]["ingress"][0]["from"]]
    assert selected(from_pods) == ["tandem-rollout"], "only rollout pods reach the trainer's gRPC"
    rollout_np = get(docs, "NetworkPolicy", "tandem-rollout")
    (peers,) = [f["podSelector"] for f in rollout_np["spec"]["ingress"][0]["from"]]
    assert selected(peers) == ["tandem-rollout"], "only rollout pods reach a rollout pod's relay"
    redis_np = get(docs, "NetworkPolicy", "tandem-redis")
    (tandem_pods,) = [f["podSelector"] for f in redis_np["spec"]["ingress"][0]["from"]]
    assert sorted(selected(tandem_pods)) == ["tandem-redis", "tandem-rollout", "tandem-trainer"]
    (keda,) = redis_np["spec"]["ingress"][1]["from"]
    assert keda["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "keda"}
    so = get(docs, "ScaledObject", "tandem-rollout")
    ref = so["spec"]["scaleTargetRef"]
    assert get(docs, ref["kind"], ref["name"])["apiVersion"] == ref["apiVersion"]
    assert "replicas" not in get(docs, "Deployment", "tandem-rollout")["spec"], "KEDA owns the replica count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_and_keda_point_at_the_same_stream(rendered, overlay, tmp_path):
    docs = rendered[overlay]
    cfg = loaded_config(docs, tmp_path, "tandem-rollout")
    svc = get(docs, "Service", "tandem-redis")
    (svc_port,) = svc["spec"]["ports"]
    url = urlsplit(get(docs, "ConfigMap", "tandem-config")["data"]["redis-url"])
    scheme = "rediss" if overlay == "gpu" else "redis"  # gpu: TLS only (test_gpu_redis_is_tls_only_...)
    assert (url.scheme, url.hostname, url.port, url.password) == (scheme, "tandem-redis", svc_port["port"], None)
    parsed = urlsplit(cfg.redis_url)  # what the pod connects with: the Secret's password merged in
    assert parsed.password == TEST_PASSWORD and parsed.hostname == "tandem-redis"

    md = get(docs, "ScaledObject", "tandem-rollout")["spec"]["triggers"][0]["metadata"]
    assert md["address"] == f"tandem-redis.{NAMESPACE}.svc.cluster.local:{svc_port['port']}"
    assert md["stream"] == Keys(run_id=cfg.run_id).prompts == f"tandem:{{{cfg.run_id}}}:prompts"
    assert md["consumerGroup"] == PROMPTS_GROUP
    assert md["databaseIndex"] == url.path.strip("/")
    so = get(docs, "ScaledObject", "tandem-rollout")["spec"]
    assert so["minReplicaCount"] == 0, "scale to zero when idle"


def test_overlays_differ_as_documented(rendered, tmp_path):
    cpu, gpu = rendered["cpu"], rendered["gpu"]
    for docs, tag in ((cpu, "-cpu"), (gpu, "-cuda")):
        images = {container(w)["image"] for w in workloads(docs)} - {"redis:7.0.15"}
        assert len(images) == 1 and images.pop().endswith(tag)
    gpu_rollout = container(get(gpu, "Deployment", "tandem-rollout"))
    assert gpu_rollout["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in str(get(cpu, "Deployment", "tandem-rollout"))
    # gpu: mutual TLS, and the config the pods then load asks for it.
    t = loaded_config(gpu, tmp_path, "tandem-trainer").trainer
    assert t.tls == ServerTLS(
        cert="/etc/tandem-tls/tls.crt", key="/etc/tandem-tls/tls.key", client_ca="/etc/tandem-tls/ca.crt"
    )
    r = loaded_config(gpu, tmp_path, "tandem-rollout").rollout
    assert r.tls.ca == "/etc/tandem-tls/ca.crt" and r.tls.cert
    assert r.relay_server_name == "tandem-rollout"  # relays present the workers' certificate to peers
    assert loaded_config(cpu, tmp_path, "tandem-rollout").rollout.relay_server_name == ""
    assert not loaded_config(cpu, tmp_path, "tandem-trainer").trainer.tls.enabled


def test_dockerfile_targets_and_the_manifests_agree(rendered):
    text = (REPO / "deploy" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M)
    assert {"cpu", "cuda"} <= set(stages)
    makefile_torch = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert set(re.findall(r"ARG TORCH_VERSION=(\S+)", text)) == {makefile_torch}
    assert text.count('ENTRYPOINT ["tandem"]') == 2
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    packages = {
        p.split("*")[0]
        for p in yaml.safe_load(
            "[" + re.search(r"include = \[(.*?)\]", (REPO / "pyproject.toml").read_text()).group(1) + "]"
        )
    }
    assert packages | {"configs"} <= copied
    (uid,) = set(re.findall(r"^USER (\d+):\d+$", text, re.M))
    for w in workloads(rendered["cpu"]):
        if w["metadata"]["name"] != "tandem-redis":
            assert w["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)
            assert container(w)["args"][0] in ("trainer", "rollout")


def test_readme_names_the_overlays_and_what_to_watch():
    text = (REPO / "deploy" / "README.md").read_text()
    for needle in (
        "deploy/k8s/overlays/cpu",
        "deploy/k8s/overlays/gpu",
        "redis.env",
        "TANDEM_REDIS_PASSWORD",
        "metrics.jsonl",
        "deadletter",
        "XINFO GROUPS",
        "9090",
        *EXTERNAL_TLS_SECRETS,
    ):
        assert needle in text, needle


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_lite_renders_what_kubectl_kustomize_renders(tree, rendered, overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: kustomize_lite is not compared with the real Kustomize here")
    out = subprocess.run(
        [kubectl, "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    real = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    mine = {(d["kind"], d["metadata"]["name"]): d for d in rendered[overlay]}
    assert sorted(mine) == sorted(real)
    for key in real:
        assert mine[key] == real[key], key


# ---------------------------------------------------------------------------------------- Redis TLS (gpu)
REDIS_TLS_DIR, CLIENT_TLS_DIR = "/etc/redis-tls/", "/etc/tandem-redis-tls/"


def test_gpu_redis_is_tls_only_with_client_certificates(rendered, tmp_path):
    """gpu: Redis listens on TLS only and requires client certificates; its files, the pods' and
    KEDA's come from the documented Secrets; the config each pod loads is rediss:// with CA, cert and
    key; KEDA's trigger is the cpu one plus TLS. cpu: none of it."""
    gpu, cpu = rendered["gpu"], rendered["cpu"]
    sts = get(gpu, "StatefulSet", "tandem-redis")
    redis = container(sts)
    args = " ".join(redis["args"])
    for flag in ("--port 0", "--tls-port 6379", "--tls-auth-clients yes"):
        assert flag in args, flag
    for flag, key in (("--tls-cert-file", "tls.crt"), ("--tls-key-file", "tls.key"), ("--tls-ca-cert-file", "ca.crt")):
        path = re.search(rf"{flag} (\S+)", args).group(1)
        assert _file_behind(sts, redis, path) == ("secret", "tandem-redis-tls", key), flag
    assert port_of(redis, "redis") == 6379
    assert "--tls" in " ".join(redis["readinessProbe"]["exec"]["command"])
    assert "--tls-port" not in " ".join(container(get(cpu, "StatefulSet", "tandem-redis"))["args"])

    for kind, name in (("StatefulSet", "tandem-trainer"), ("Deployment", "tandem-rollout")):
        w = get(gpu, kind, name)
        env = resolve_env(gpu, container(w))
        for var, key in (("TANDEM_REDIS_CA_FILE", "ca.crt"), ("TANDEM_REDIS_CERT_FILE", "tls.crt"),
                         ("TANDEM_REDIS_KEY_FILE", "tls.key")):  # fmt: skip
            assert _file_behind(w, container(w), env[var]) == ("secret", "tandem-redis-client-tls", key), (name, var)
        url = urlsplit(loaded_config(gpu, tmp_path, name).redis_url)
        query = {k: v for k, (v,) in parse_qs(url.query).items()}
        assert url.scheme == "rediss" and url.password == TEST_PASSWORD, name
        assert {query["ssl_ca_certs"], query["ssl_certfile"], query["ssl_keyfile"]} == {
            env["TANDEM_REDIS_CA_FILE"],
            env["TANDEM_REDIS_CERT_FILE"],
            env["TANDEM_REDIS_KEY_FILE"],
        }
        assert "ssl" not in loaded_config(cpu, tmp_path, name).redis_url

    (gpu_trigger,) = get(gpu, "ScaledObject", "tandem-rollout")["spec"]["triggers"]
    (cpu_trigger,) = get(cpu, "ScaledObject", "tandem-rollout")["spec"]["triggers"]
    assert gpu_trigger["metadata"] == {**cpu_trigger["metadata"], "enableTLS": "true"}
    assert {k: v for k, v in gpu_trigger.items() if k not in ("metadata", "authenticationRef")} == {
        k: v for k, v in cpu_trigger.items() if k != "metadata"
    }
    auth = get(gpu, "TriggerAuthentication", gpu_trigger["authenticationRef"]["name"])
    assert {(r["parameter"], r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]} == {
        ("ca", "tandem-redis-client-tls", "ca.crt"),
        ("cert", "tandem-redis-client-tls", "tls.crt"),
        ("key", "tandem-redis-client-tls", "tls.key"),
    }
    readme = (REPO / "deploy" / "README.md").read_text()
    assert "tandem-redis-tls" in readme and "tandem-redis-client-tls" in readme


@pytest.mark.integration
def test_gpu_redis_tls_runs_on_a_real_redis(rendered, tmp_path, free_port):
    """The gpu Redis container's own command line, run by a real redis-server (the Secret files and
    the volume swapped for local ones), accepts the URL a trainer pod builds from its environment,
    and refuses it without the client certificate."""
    import asyncio

    from tls_certs import make_certs

    from broker.outage import RedisOutage
    from broker.streams import connect

    gpu = rendered["gpu"]
    certs = tmp_path / "certs"
    certs.mkdir()
    make_certs(certs, ("server", "client"))
    for name, src in (("tls.crt", "server.crt"), ("tls.key", "server.key")):
        (certs / "server").mkdir(exist_ok=True)
        (certs / "server" / name).write_bytes((certs / src).read_bytes())
    (certs / "server" / "ca.crt").write_bytes((certs / "ca.crt").read_bytes())
    (tmp_path / "data").mkdir()
    port = free_port()
    cmd = " ".join(container(get(gpu, "StatefulSet", "tandem-redis"))["args"])
    cmd = cmd.replace(REDIS_TLS_DIR, f"{certs}/server/").replace("--dir /data", f"--dir {tmp_path / 'data'}")
    cmd = cmd.replace("--tls-port 6379", f"--tls-port {port} --bind 127.0.0.1")
    proc = subprocess.Popen(["sh", "-c", cmd], env={"REDIS_PASSWORD": TEST_PASSWORD, "PATH": "/usr/bin:/bin"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        env = resolve_env(gpu, container(get(gpu, "StatefulSet", "tandem-trainer")))
        for var, name in (("TANDEM_REDIS_CA_FILE", "ca.crt"), ("TANDEM_REDIS_CERT_FILE", "client.crt"),
                          ("TANDEM_REDIS_KEY_FILE", "client.key")):  # fmt: skip
            env[var] = str(certs / name)
        env["TANDEM_REDIS_URL"] = env["TANDEM_REDIS_URL"].replace("tandem-redis:6379", f"127.0.0.1:{port}")
        url = run_config.load(None, env_config.env_overrides(env)).redis_url
        without_cert = env_config.redis_url_with(
            env["TANDEM_REDIS_URL"], password=TEST_PASSWORD, ca_file=str(certs / "ca.crt")
        )

        async def main() -> None:
            deadline = asyncio.get_running_loop().time() + 60
            while True:  # until redis-server listens
                assert proc.poll() is None, f"redis-server exited {proc.returncode}: {cmd}"
                try:
                    async with connect(url, outage_s=1, log=lambda s: None) as r:
                        assert await r.ping()
                    break
                except RedisOutage:
                    assert asyncio.get_running_loop().time() < deadline, "the TLS Redis never answered"
            async with connect(without_cert, outage_s=1, log=lambda s: None) as r:
                with pytest.raises(RedisOutage):
                    await r.ping()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
