"""Policy distribution against the pool's size: N fetch-only workers, one serving setup, one run.

    python3 bench/bench_distribution.py                       # N = 1..32, 1 and 2 serving processes, 256 MB
    python3 bench/bench_distribution.py --workers 1,2,4 --mb 64 --versions 3

Each worker is a process of its own running the real client (broker.policy_client.PolicyClient: every
chunk's xxh3 and every tensor's sha256 checked, into ReceiveBuffers reused across versions, as a
rollout worker's fetch). The policy is `--mb` of bf16 tensors of 2 MiB (the contract's bytes; the
format does not change what travels), new random content per version, framed into shared pool
buffers and published to `--serving` policy-server processes on one port (ServingProcesses). Per
version: publish (install in every serving process), then every worker is told the version (a pipe:
the Redis announcement left out) and fetches it. Printed per (serving processes, N):
- egress: bytes the serving processes sent per version (their `sent_bytes`), and as x one version;
- publish->live p50 / p99 over workers and versions (from the publish call to a worker's verified fetch);
- CPU seconds per GB sent, on the serving side (the children's /proc times) and the worker side;
- the ratio of each N's p50 to N = the first's (the pool-size target: within 2x at N = 32 of N = 2).
Version 1 of each setup is a warm-up (buffers allocated, connections made) and not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from broker import frames  # noqa: E402
from broker.policy_client import PolicyClient, PolicyClientConfig, ReceiveBuffers  # noqa: E402
from broker.policy_server import PolicyServerConfig  # noqa: E402
from broker.server_process import ServingProcesses  # noqa: E402
from policy import manifest as M  # noqa: E402
from policy.formats.params import quantize_param  # noqa: E402

CONTRACT = M.Contract(model_config={"bench": "distribution"}, recipe_name="bf16", recipe_rules={"rules": []})
TENSOR_BYTES = 2 << 20


def policy(mb: int, seed: int) -> dict[str, M.QuantizedParam]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, (mb << 20) // TENSOR_BYTES)
    shape = (TENSOR_BYTES // 2 // 1024, 1024)
    return {
        f"model.layers.{i}.mlp.weight": quantize_param(torch.randn(*shape, generator=g, dtype=torch.bfloat16), "bf16")
        for i in range(n)
    }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(address: str, fingerprint: str) -> int:
    """A fetch-only worker: a version number per stdin line, one JSON line per verified fetch."""
    client = PolicyClient(PolicyClientConfig(address=address, expected_fingerprint=fingerprint, fetch_timeout_s=600))
    buffers = ReceiveBuffers()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        version = int(line)
        cpu = time.process_time()
        fetched = client.fetch(version, buffers=buffers)
        received = sum(t.nbytes for t in fetched.manifest.tensors)
        print(json.dumps({"v": version, "t": time.monotonic(), "cpu": time.process_time() - cpu, "bytes": received}))
        sys.stdout.flush()
    client.close()
    return 0


def measure(n: int, serving: int, mb: int, versions: int) -> dict:
    """One setup: `serving` processes, `n` workers, `versions` versions (the first a warm-up)."""
    pool = frames.BufferPool(shared=True)
    server = ServingProcesses(PolicyServerConfig(keep_versions=2), processes=serving, log=print)
    server.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", server.address, CONTRACT.fingerprint()]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    live, worker_cpu, worker_bytes, sent, served_cpu = [], 0.0, 0, 0, 0.0
    try:
        for p in procs:
            assert json.loads(p.stdout.readline()).get("ready"), "a worker did not start"
        for v in range(1, versions + 1):
            f = frames.build_framed(
                version=v, parent_version=v - 1 if v > 1 else None, contract=CONTRACT, tensors=policy(mb, v), pool=pool
            )
            sent0, cpu0 = server.stats()["bytes_sent"], sum(cpu_seconds(pid) for pid in server.pids)
            t0 = time.monotonic()
            server.publish(f)
            for p in procs:
                p.stdin.write(f"{v}\n")
                p.stdin.flush()
            done = [json.loads(p.stdout.readline()) for p in procs]
            if v == 1:
                continue
            live += [d["t"] - t0 for d in done]
            worker_cpu += sum(d["cpu"] for d in done)
            worker_bytes += sum(d["bytes"] for d in done)
            sent += server.stats()["bytes_sent"] - sent0
            served_cpu += sum(cpu_seconds(pid) for pid in server.pids) - cpu0
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
        server.stop()
        pool.close()
    counted = versions - 1
    live.sort()
    return {
        "workers": n,
        "serving": serving,
        "egress_bytes_per_version": sent / counted,
        "version_bytes": worker_bytes / counted / n,
        "live_p50_s": statistics.median(live),
        "live_p99_s": live[min(len(live) - 1, round(0.99 * (len(live) - 1)))],
        "server_cpu_s_per_gb": served_cpu / (sent / 1e9),
        "worker_cpu_s_per_gb": worker_cpu / (worker_bytes / 1e9),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4,8,16,32", help="pool sizes N, comma-separated")
    ap.add_argument("--serving", default="1,2", help="serving processes, comma-separated")
    ap.add_argument("--mb", type=int, default=256, help="policy size in MiB")
    ap.add_argument("--versions", type=int, default=4, help="versions per setup (the first is a warm-up)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--worker", nargs=2, metavar=("ADDRESS", "FINGERPRINT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    if args.versions < 2:
        ap.error("--versions must be >= 2 (the first is a warm-up)")
    rows = []
    print(f"policy {args.mb} MiB, {args.versions - 1} counted versions per setup, {os.cpu_count()} cores")
    print(f"{'serving':>7} {'N':>3} {'egress/version':>15} {'x version':>9} {'live p50':>9} {'p99':>8} "
          f"{'vs first N':>10} {'srv cpu/GB':>10} {'wkr cpu/GB':>10}")  # fmt: skip
    for serving in (int(s) for s in args.serving.split(",")):
        first = None
        for n in (int(s) for s in args.workers.split(",")):
            r = measure(n, serving, args.mb, args.versions)
            first = first or r["live_p50_s"]
            rows.append(r)
            print(
                f"{serving:>7} {n:>3} {r['egress_bytes_per_version'] / 1e6:>12.1f} MB "
                f"{r['egress_bytes_per_version'] / r['version_bytes']:>9.3f} {r['live_p50_s']:>8.3f}s "
                f"{r['live_p99_s']:>7.3f}s {r['live_p50_s'] / first:>10.3f} "
                f"{r['server_cpu_s_per_gb']:>9.3f}s {r['worker_cpu_s_per_gb']:>9.3f}s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
