"""Policy distribution against the pool's size: N fetch-only workers, with and without relays and deltas.

    python3 bench/bench_distribution.py --mb 128 --fanout 0,4 --delta 0,0.05
    python3 bench/bench_distribution.py --workers 1,2,4 --mb 32 --fanout 2,4 --delta --versions 3

Each worker is a process of its own running the real client (broker.policy_client.PolicyClient: every
chunk's xxh3 and every tensor's sha256 checked, into ReceiveBuffers reused across versions, the held
version offered as `parent=` as a rollout worker's in-process fetch does). The policy is `--mb` of
bf16 tensors of 2 MiB, framed into shared pool buffers and published to `--serving` policy-server
processes (ServingProcesses: the trainer's side). Versions: `--delta 0` = new random content each;
`--delta P` = P of the previous version's bytes changed, scattered (the low byte of random bf16
elements), and deltas on in every server. `--fanout 0`: every worker fetches from the trainer's
servers; F >= 1: each worker runs a broker.relay.Relay on a free loopback port, offers every version
it verified if it has children in the tree (a leaf's copy has no reader here), and fetches from its sources per broker.fanout.sources over the members' relay
addresses (waiting up to `--relay-wait-s` for a relay to hold the version, falling back to the next
source on any error). Per version: publish, then every worker is told the version (a pipe: the
Redis announcement left out). Printed per (fanout, delta, N):
- depth (hops to the deepest worker); egress: bytes the trainer's servers sent per version, and as
  x one version; relays' sent bytes per version; wire bytes of one fetch as % of the version;
- publish->live p50 / p99 over workers and versions (publish call to a worker's verified fetch);
- CPU seconds per GB of versions delivered (version bytes x fetches served) on the trainer side (the
  serving children's /proc times), the relay side (a worker's process time outside its own fetches)
  and the worker side (its fetches); fetches that fell back to a later source;
- egress and p50 as a ratio to N = 2's (the targets: egress within 1.2x and p50 within 2x at N = 32
  with relays), and the targets' ratios again at the end, 3 digits.
Version 1 of each setup is a warm-up (buffers allocated, connections made, a full version for the
deltas' parent) and not counted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from broker import fanout, frames  # noqa: E402
from broker.policy_client import PolicyClient, PolicyClientConfig, ReceiveBuffers  # noqa: E402
from broker.policy_server import PolicyServerConfig  # noqa: E402
from broker.relay import Relay  # noqa: E402
from broker.server_process import ServingProcesses  # noqa: E402
from policy import manifest as M  # noqa: E402
from policy.formats.params import quantize_param  # noqa: E402

CONTRACT = M.Contract(model_config={"bench": "distribution"}, recipe_name="bf16", recipe_rules={"rules": []})
TENSOR_BYTES = 2 << 20
# Every worker connects from 127.0.0.1, one "peer" to the server's per-peer stream cap: lifted here
STREAM_LIMITS = {"max_streams_per_peer": 1024, "max_unauthenticated_streams": 1024, "max_concurrent_rpcs": 2048}


class Versions:
    """The bench's policy versions: bf16 tensors of 2 MiB, new random content each (`fraction` 0) or
    the previous version with `fraction` of its bytes changed (the low byte of random elements:
    always finite values)."""

    def __init__(self, mb: int, fraction: float, seed: int = 0):
        self.n = max(1, (mb << 20) // TENSOR_BYTES)
        self.fraction, self.rng = fraction, np.random.default_rng(seed)
        self.current: list[np.ndarray] = []

    def next(self, version: int) -> dict[str, M.QuantizedParam]:
        if not self.current or not self.fraction:
            g = torch.Generator().manual_seed(version)
            self.current = [torch.randn(TENSOR_BYTES // 2, generator=g, dtype=torch.bfloat16).view(torch.uint8).numpy()
                            for _ in range(self.n)]  # fmt: skip
        else:
            k = max(1, round(self.fraction * TENSOR_BYTES))
            for i, old in enumerate(self.current):
                new = old.copy()
                low = 2 * self.rng.integers(0, TENSOR_BYTES // 2, k)  # little-endian: byte 0 is the low one
                new[low] ^= self.rng.integers(1, 256, k, dtype=np.uint8)
                self.current[i] = new
        shape = (TENSOR_BYTES // 2 // 1024, 1024)
        return {
            f"model.layers.{i}.mlp.weight": quantize_param(torch.from_numpy(a).view(torch.bfloat16).view(shape), "bf16")
            for i, a in enumerate(self.current)
        }


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fetch_from(clients: list[PolicyClient], version: int, buffers: ReceiveBuffers, held, wait_s: float):
    """`version` from the first source that serves it verified: (fetched, source index, fallbacks).
    A relay (every source but the last, the trainer) is first waited for until it holds the version."""
    failures = 0
    for i, client in enumerate(clients):
        try:
            if i < len(clients) - 1 and not any(
                a.version >= version for a in client.watch_versions(version - 1, timeout_s=wait_s)
            ):
                raise TimeoutError(f"relay {client.config.address} did not get version {version} in {wait_s} s")
            return client.fetch(version, buffers=buffers, parent=held), i, failures
        except Exception as e:  # noqa: BLE001 (any failure: the next source)
            print(f"version {version} from {client.config.address}: {type(e).__name__}: {e}", file=sys.stderr)
            failures += 1
            held = None  # a failed fetch may have written over the parent
    raise RuntimeError(f"version {version}: every source failed")


def worker(trainer: str, fingerprint: str, degree: int, wait_s: float, deltas: bool) -> int:
    """A fetch-only worker (a relay too when degree >= 1). stdin: the members' relay addresses (a
    JSON list), then a version number per line (0: report and end); stdout: one JSON line each."""
    relay = Relay(PolicyServerConfig(keep_versions=2, deltas=deltas, **STREAM_LIMITS)) if degree else None
    me = f"127.0.0.1:{relay.start()}" if relay else ""
    print(json.dumps({"ready": True, "relay": me}), flush=True)
    members = json.loads(sys.stdin.readline())
    chain = fanout.sources(members, degree, me) if relay else [fanout.TRAINER]
    # a member with children in the tree offers (one without has no reader here: its copy is skipped)
    serves = relay is not None and any(me in fanout.sources(members, degree, m)[:1] for m in members)
    addresses = [trainer if s == fanout.TRAINER else s for s in chain]
    clients = [PolicyClient(PolicyClientConfig(address=a, expected_fingerprint=fingerprint, fetch_timeout_s=600))
               for a in addresses]  # fmt: skip
    buffers, held, mark = ReceiveBuffers(), None, time.process_time()
    for line in sys.stdin:
        version = int(line)
        report = {"v": version, "relay_cpu": time.process_time() - mark,
                  "relay_sent": relay.server.stats()["bytes_sent"] if relay else 0}  # fmt: skip
        if version == 0:
            print(json.dumps(report), flush=True)
            break
        cpu = time.process_time()
        fetched, source, failures = fetch_from(clients, version, buffers, held, wait_s)
        t, mark = time.monotonic(), time.process_time()
        held = fetched.held()
        if serves:
            relay.offer(fetched.manifest, fetched.data)
        received = sum(e.nbytes for e in fetched.manifest.tensors)
        print(json.dumps({**report, "t": t, "cpu": mark - cpu, "bytes": received, "wire": fetched.stats.bytes,
                          "from_trainer": source == len(clients) - 1, "fallbacks": failures,
                          "depth": len(chain)}), flush=True)  # fmt: skip
    for c in clients:
        c.close()
    if relay:
        relay.stop()
    return 0


def start_workers(n: int, server: ServingProcesses, degree: int, args) -> list[subprocess.Popen]:
    """`n` worker processes, started and told the members' relay addresses (in start order)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        server.address,
        CONTRACT.fingerprint(),
        str(degree),
        str(args.relay_wait_s),
        str(int(server.config.deltas)),
    ]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    members = []
    for p in procs:
        hello = json.loads(p.stdout.readline())
        assert hello.get("ready"), "a worker did not start"
        members.append(hello["relay"])
    for p in procs:
        tell(p, json.dumps(members))
    return procs


def tell(p: subprocess.Popen, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def run_versions(procs, server: ServingProcesses, pool: frames.BufferPool, versions: Versions, count: int):
    """Publish `count` versions, each fetched by every worker: per version, every worker's report
    plus the trainer's sent bytes and CPU seconds and the publish time `t0`; then the workers' last
    report (the last version's relaying). The workers have ended when it returns."""
    out = []
    try:
        for v in range(1, count + 1):
            f = frames.build_framed(
                version=v,
                parent_version=v - 1 if v > 1 else None,
                contract=CONTRACT,
                tensors=versions.next(v),
                pool=pool,
            )
            sent0, cpu0 = server.stats()["bytes_sent"], sum(cpu_seconds(pid) for pid in server.pids)
            t0 = time.monotonic()
            server.publish(f)
            for p in procs:
                tell(p, str(v))
            done = [json.loads(p.stdout.readline()) for p in procs]
            out.append({"t0": t0, "workers": done, "sent": server.stats()["bytes_sent"] - sent0,
                        "cpu": sum(cpu_seconds(pid) for pid in server.pids) - cpu0})  # fmt: skip
        for p in procs:
            tell(p, "0")
        out.append({"workers": [json.loads(p.stdout.readline()) for p in procs]})  # the last version's relaying
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    return out


def measure(n: int, degree: int, fraction: float, args) -> dict:
    """One setup: `n` workers, fan-out `degree` (0: none), versions changing `fraction` (0: all)."""
    pool = frames.BufferPool(shared=True)
    config = PolicyServerConfig(keep_versions=2, deltas=fraction > 0, **STREAM_LIMITS)
    server = ServingProcesses(config, processes=args.serving, log=print)
    server.start()
    try:
        procs = start_workers(n, server, degree, args)
        out = run_versions(procs, server, pool, Versions(args.mb, fraction), args.versions)
    finally:
        server.stop()
        pool.close()
    return summarize(n, degree, fraction, out)


def summarize(n: int, degree: int, fraction: float, out: list[dict]) -> dict:
    """The printed figures of one setup from run_versions' records (version 1 left out)."""
    counted = out[1:-1]
    reports = [d for v in counted for d in v["workers"]]
    relayed = [(b["relay_sent"] - a["relay_sent"], b["relay_cpu"]) for k in range(1, len(out) - 1)
               for a, b in zip(out[k]["workers"], out[k + 1]["workers"])]  # fmt: skip
    version_bytes = reports[0]["bytes"]
    from_trainer = sum(d["from_trainer"] for d in reports)
    live = sorted(d["t"] - v["t0"] for v in counted for d in v["workers"])
    sent = sum(v["sent"] for v in counted) / len(counted)
    per_gb = lambda cpu, fetches: cpu / (version_bytes * fetches / 1e9) if fetches else float("nan")
    return {
        "fanout": degree,
        "delta": fraction,
        "workers": n,
        "depth": max(d["depth"] for d in reports),
        "version_bytes": version_bytes,
        "egress_bytes_per_version": sent,
        "relay_bytes_per_version": sum(b for b, _ in relayed) / len(counted),
        "wire_pct": 100 * statistics.mean(d["wire"] for d in reports) / version_bytes,
        "live_p50_s": statistics.median(live),
        "live_p99_s": live[min(len(live) - 1, round(0.99 * (len(live) - 1)))],
        "trainer_cpu_s_per_gb": per_gb(sum(v["cpu"] for v in counted), from_trainer),
        "relay_cpu_s_per_gb": per_gb(sum(c for _, c in relayed), len(reports) - from_trainer),
        "worker_cpu_s_per_gb": per_gb(sum(d["cpu"] for d in reports), len(reports)),
        "fallbacks": sum(d["fallbacks"] for d in reports),
    }


HEADER = (f"{'F':>2} {'delta':>5} {'N':>3} {'depth':>5} {'egress/ver':>11} {'x ver':>6} {'vs N=2':>6} "
          f"{'relays/ver':>11} {'wire':>6} {'live p50':>9} {'p99':>8} {'vs N=2':>6} "
          f"{'cpu/GB trn':>10} {'rly':>6} {'wkr':>6} {'fallbk':>6}")  # fmt: skip


def row_line(r: dict, base: dict) -> str:
    """One printed row; `base` is the same setup's N = 2 row (None before it: the ratios print 0)."""
    v = r["version_bytes"]
    base = base or {"egress_bytes_per_version": math.inf, "live_p50_s": math.inf}
    return (
        f"{r['fanout']:>2} {r['delta']:>5.3f} {r['workers']:>3} {r['depth']:>5} "
        f"{r['egress_bytes_per_version'] / 1e6:>8.1f} MB {r['egress_bytes_per_version'] / v:>6.3f} "
        f"{r['egress_bytes_per_version'] / base['egress_bytes_per_version']:>6.3f} "
        f"{r['relay_bytes_per_version'] / 1e6:>8.1f} MB {r['wire_pct']:>5.1f}% "
        f"{r['live_p50_s']:>8.3f}s {r['live_p99_s']:>7.3f}s {r['live_p50_s'] / base['live_p50_s']:>6.3f} "
        f"{r['trainer_cpu_s_per_gb']:>9.3f}s {r['relay_cpu_s_per_gb']:>5.2f}s {r['worker_cpu_s_per_gb']:>5.2f}s "
        f"{r['fallbacks']:>6}"
    )


def targets(rows: list[dict]) -> list[str]:
    """The targets' measured ratios, N = 32 (or the largest N) against N = 2, per setup with relays."""
    lines = []
    for degree, fraction in dict.fromkeys((r["fanout"], r["delta"]) for r in rows):
        setup = {r["workers"]: r for r in rows if (r["fanout"], r["delta"]) == (degree, fraction)}
        if 2 not in setup or max(setup) <= 2:
            continue
        big, two = setup[max(setup)], setup[2]
        egress = big["egress_bytes_per_version"] / two["egress_bytes_per_version"]
        live = big["live_p50_s"] / two["live_p50_s"]
        lines.append(
            f"F={degree} delta={fraction:.3f}: egress N={max(setup)}/N=2 {egress:.3f}, "
            f"{big['egress_bytes_per_version'] / big['version_bytes']:.3f} x version (target <= 1.2 with relays: "
            f"{'met' if egress <= 1.2 else 'MISSED'}), publish->live p50 N={max(setup)}/N=2 {live:.3f} "
            f"(target <= 2: {'met' if live <= 2 else 'MISSED'})"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4,8,16,32", help="pool sizes N, comma-separated")
    ap.add_argument("--fanout", default="0,4", help="fan-out degrees, comma-separated (0: no relays)")
    ap.add_argument("--delta", nargs="?", const="0.05", default="0",
                    help="fractions of bytes changed per version, comma-separated (0: full versions; "
                         "the flag alone: 0.05, the 4-bit recipes' measured size)")  # fmt: skip
    ap.add_argument("--serving", type=int, default=1, help="the trainer's serving processes")
    ap.add_argument("--mb", type=int, default=128, help="policy size in MiB")
    ap.add_argument("--versions", type=int, default=4, help="versions per setup (the first is a warm-up)")
    ap.add_argument("--relay-wait-s", type=float, default=120.0, help="how long a worker waits for its relay")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--worker", nargs=5, metavar=("ADDRESS", "FINGERPRINT", "F", "WAIT", "DELTAS"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.worker:
        a = args.worker
        return worker(a[0], a[1], int(a[2]), float(a[3]), a[4] == "1")
    if args.versions < 2:
        ap.error("--versions must be >= 2 (the first is a warm-up)")
    rows = []
    print(f"policy {args.mb} MiB, {args.versions - 1} counted versions per setup, {args.serving} serving "
          f"process(es), {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(HEADER)
    for degree in (int(s) for s in args.fanout.split(",")):
        for fraction in (float(s) for s in args.delta.split(",")):
            setup = []
            for n in (int(s) for s in args.workers.split(",")):
                setup.append(measure(n, degree, fraction, args))
                base = next((r for r in setup if r["workers"] == 2), None)
                print(row_line(setup[-1], base), flush=True)
                if args.json:  # row by row: a run cut short keeps its rows
                    Path(args.json).write_text(json.dumps(rows + setup, indent=1))
            rows += setup
    print(f"load {os.getloadavg()[0]:.1f}")
    for line in targets(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
