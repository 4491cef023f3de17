"""Policy distribution at pool scale, extrapolated: trainer egress and publish->live per version.

    python3 bench/model_distribution.py            # the assumptions below, the table docs/benchmarks.md quotes

Store-and-forward over the fan-out tree (broker.fanout: a relay offers a version once it holds it
whole and verified). A server with k readers at once gives each r = min(s, C / k, W / k): s one
fetch stream's verified rate, C the server's rate (P serving processes on the trainer, one on a
relay), W the pod's NIC. One hop moves the wire bytes b (the full version B, or a delta d x B)
and then rebuilds/verifies the whole version at h; a relay copies it into its serving buffer (B / m)
before its children start. With depth D (broker.fanout's tree: the first F members at depth 1, the
next F^2 at 2, ...; = ceil(log_F N) at these N):
    hop(k, C) = b / min(s, C / k, W / k) + B / h
    live = hop(min(N, F), P C) + (D - 1) (hop(F, C) + B / m)   (F = 0: D = 1 and k = N)
    egress per version = min(N, F) x b   (F = 0: N x b)
Printed per (model, delta, N): egress and live without relays and with F = 2 and 4.
"""

from __future__ import annotations

import argparse
import sys


def depth(n: int, degree: int) -> int:
    """Hops to the deepest of `n` members in broker.fanout's tree of `degree` (0: 1)."""
    if degree == 0:
        return 1
    d, covered, level = 0, 0, 1
    while covered < n:
        level *= degree
        covered += level
        d += 1
    return d


def live_s(n: int, degree: int, full: float, wire: float, a) -> float:
    """publish->live of the deepest member (seconds), per the formula in the module docstring."""
    rate = lambda k, c: min(a.stream, c / k, a.nic / k)
    hop = lambda k, c: wire / rate(k, c) + full / a.rebuild
    if degree == 0:
        return hop(n, a.processes * a.server)
    return hop(min(n, degree), a.processes * a.server) + (depth(n, degree) - 1) * (
        hop(degree, a.server) + full / a.copy
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream", type=float, default=1.04, help="s: one verified fetch stream, GB/s (H200 host)")
    ap.add_argument("--server", type=float, default=1.8, help="C: one serving process, GB/s (H200 host)")
    ap.add_argument("--processes", type=int, default=4, help="P: the trainer's serving processes")
    ap.add_argument("--nic", type=float, default=25.0, help="W: a pod's NIC, GB/s")
    ap.add_argument("--rebuild", type=float, default=20.0, help="h (full): verify tail, GB/s of the version")
    ap.add_argument("--rebuild-delta", type=float, default=2.0, help="h (delta): decode + hash, GB/s")
    ap.add_argument("--copy", type=float, default=7.5, help="m: a relay's copy into its buffer, GB/s")
    ap.add_argument("--delta", type=float, default=0.099, help="d: delta bytes / full (bench_delta, nvfp4_moe)")
    ap.add_argument("--workers", default="8,32,128,256")
    args = ap.parse_args()
    models = (("Qwen3-30B-A3B", 16.0), ("Qwen3-235B-A22B", 120.0))
    print("| model | version | N | egress: none | F=2 | F=4 | live: none | F=2 | F=4 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, gb in models:
        for kind, wire, h in (("full", gb, args.rebuild), ("delta", args.delta * gb, args.rebuild_delta)):
            a = argparse.Namespace(**{**vars(args), "rebuild": h})
            for n in (int(x) for x in args.workers.split(",")):
                egress = [n * wire, min(n, 2) * wire, min(n, 4) * wire]
                live = [live_s(n, f, gb, wire, a) for f in (0, 2, 4)]
                print(
                    f"| {name} | {kind} ({wire:.1f} GB) | {n} | "
                    + " | ".join(f"{e:,.0f} GB" for e in egress)
                    + " | "
                    + " | ".join(f"{t:,.0f} s" for t in live)
                    + " |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
