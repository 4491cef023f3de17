"""What the 4-bit matmul kernels issue per K tile, from their SASS for sm_90: no GPU needed.

Compiles `matmul_triton._w4a16_kernel` (dense and MoE launches) and `_moe_persistent_kernel` for
sm_90 with Triton's own ptxas, disassembles the cubin with the cuobjdump in Triton's wheel, takes
the main loop (the longest backward branch: one K tile per trip) and counts its instructions by
opcode. A trip is one K tile of BN/num_warps weight rows per warp: BK/2 bytes of codes a row. The
issue floor of a layer is its code bytes times the loop's instructions per byte over what the SMs
can issue (4 warp-instructions a cycle per SM, every cycle): the time the loops alone would take if
no scheduler ever stalled, to set beside the HBM floor (bytes over bandwidth). Work outside the loop
(address set-up, the epilogue) is counted statically and left out of the floor.

    pip install triton==3.6.0   # the CPU wheel carries ptxas and cuobjdump
    PYTHONPATH=. python bench/sass_census.py [--sms 132 --ghz 1.98]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rollout.kernels import matmul_triton as mt

# Code bytes a layer reads at decode: a dense 8192x8192, and Qwen3-30B-A3B's expert projections at
# T = 64 tokens (126 of 128 experts routed under uniform top-8 routing).
DENSE = 8192 * 8192 // 2
GATE_UP = 126 * 1536 * 2048 // 2
DOWN = 126 * 2048 * 768 // 2
# (layer, kernel, config (BN, BK, num_warps, num_stages, SPLIT), code bytes): the tables' entries and one wider tile
CASES = [
    ("dense 8192x8192", "dense", mt.CONFIGS[(8192, 8192)], DENSE),
    ("gate_up, one program per item", "moe", mt.MOE_CONFIGS[(1536, 2048)], GATE_UP),
    ("gate_up, persistent", "persistent", mt.MOE_CONFIGS[(1536, 2048)], GATE_UP),
    ("gate_up BN 64, one program per item", "moe", (64, 256, 2, 3, 1), GATE_UP),
    ("down, one program per item", "moe", mt.MOE_CONFIGS[(2048, 768)], DOWN),
    ("down, persistent", "persistent", mt.MOE_CONFIGS[(2048, 768)], DOWN),
]

_ARGS = {
    "dense": "x_ptr w_ptr s_ptr gs_ptr y_ptr M N K stride_xm stride_ym stride_wn stride_sn pair_ptr "
    "block_expert_ptr num_blocks_ptr stride_we stride_se ws_ptr lock_ptr xs_ptr",
    "persistent": "x_ptr w_ptr s_ptr gs_ptr y_ptr N K stride_xm stride_ym stride_wn stride_sn pair_ptr "
    "block_expert_ptr num_blocks_ptr stride_we stride_se xs_ptr",
}
_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i32", "gs_ptr": "*fp32", "y_ptr": "*bf16", "pair_ptr": "*i32",
          "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32", "ws_ptr": "*fp32", "lock_ptr": "*i32",
          "xs_ptr": "*fp32"}  # fmt: skip


def compile_kernel(kind: str, fmt: int, cfg):
    """One kernel variant compiled for sm_90 (its cubin and shared memory in `.asm` / `.metadata`),
    every pointer and integer argument taken as divisible by 16 (as the launcher's specialization
    finds them for these shapes), M > 1."""
    bn, bk, warps, stages, split = cfg[:5]
    names = _ARGS["persistent" if kind == "persistent" else "dense"].split()
    sig = {n: _TYPES.get(n, "i32") for n in names}
    sig["s_ptr"] = "*u8" if fmt == mt.FMT_NVFP4 else "*bf16"
    const = {"FMT": fmt, "G": 32, "HAS_XS": False, "TOPK": 8, "BN": bn, "BK": bk, "BM": 16, "USE_ASM": True}
    if kind != "persistent":
        const |= {"MOE": kind == "moe", "SPLIT": split}
    sig |= dict.fromkeys(const, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
    fn = mt._moe_persistent_kernel if kind == "persistent" else mt._w4a16_kernel
    opts = {"num_warps": warps, "num_stages": stages}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def census(kernel) -> dict:
    """{"loop": Counter of the main loop's opcodes, "outside": instructions elsewhere, "regs", "smem"}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ins = [
        (int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    ]
    branches = [(int(a, 16), int(t, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/[^;]*BRA 0x([0-9a-f]+)", sass)]
    lo, hi = max(((t, a) for a, t in branches if t < a), key=lambda r: r[1] - r[0])  # the longest backward branch
    loop = collections.Counter(op for a, op in ins if lo <= a <= hi and op != "NOP")
    regs = re.search(r"REG:(\d+)", res)
    return {
        "loop": loop,
        "outside": sum(1 for a, op in ins if not lo <= a <= hi and op not in ("NOP", "BRA")),
        "regs": int(regs.group(1)) if regs else 0,
        "smem": kernel.metadata.shared,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=132, help="SMs (H100 SXM and H200: 132)")
    ap.add_argument("--ghz", type=float, default=1.98, help="SM clock (H100 SXM / H200 boost: 1.98)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90; issue floors at {args.sms} SMs x {args.ghz} GHz x 4 per cycle")
    for name, kind, cfg, layer_bytes in CASES:
        for fmt, fname in ((mt.FMT_NVFP4, "nvfp4"), (mt.FMT_INT4, "int4")):
            c = census(compile_kernel(kind, fmt, cfg))
            total = sum(c["loop"].values())
            code_bytes = cfg[0] // cfg[2] * cfg[1] // 2  # per warp and trip
            per_kb = total / code_bytes * 1024
            floor_us = layer_bytes / 1024 * per_kb / (4 * args.sms * args.ghz * 1e3)
            top = ", ".join(f"{op} {n}" for op, n in c["loop"].most_common(8))
            print(
                f"{name} {cfg} {fname}: {total} instructions a trip per warp ({code_bytes} code bytes: "
                f"{per_kb:.0f} per KB), {c['outside']} outside the loop, {c['regs']} registers, "
                f"{c['smem']} B shared; issue floor {floor_us:.1f} us for {layer_bytes / 1e6:.0f} MB of codes"
                f"\n    {top}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
