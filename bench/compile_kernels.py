"""Compile every Triton kernel variant for sm_90 without a GPU and print registers / spills.

Catches type and syntax errors before any device time is spent, and shows whether a variant
spills; `--sass` also prints registers and SASS instruction counts (the budgets in docs/design-decisions.md's kernel
entries are counted this way). Needs Triton importable
(e.g. `pip install --target /tmp/tritonlocal triton==3.6.0` and PYTHONPATH=/tmp/tritonlocal:.);
needs no GPU and no CUDA driver.

    PYTHONPATH=/tmp/tritonlocal:. python bench/compile_kernels.py [--only NAME] [--sass] [--ptx DIR]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from policy.kernels import quant_triton as qt
from rollout.kernels import matmul_triton as mt

TARGET = GPUTarget("cuda", 90, 32)
IN_PTR = {0: "*i16", 1: "*fp16", 2: "*i32"}


def variants():
    for kind in (0, 1, 2):
        xp = IN_PTR[kind]
        yield (
            "amax",
            qt._amax_bits_kernel,
            {"x_ptr": xp, "status_ptr": "*i32", "numel": "i32"},
            {"IN_KIND": kind, "BLOCK": 8192},
            8,
        )
        for row, rows, chunk, single, warps in (
            (True, 1, 512, True, 4),
            (True, 1, 512, True, 8),
            (False, 1, 256, True, 4),
            (True, 1, 256, False, 8),
            (True, 8, 16, True, 4),
        ):
            for sw in (False, True) if kind == 0 and warps == 4 else (False,):
                yield (
                    f"nvfp4 kind={kind} row={row} rows={rows} chunk={chunk} single={single} sw={sw} warps={warps}",
                    qt._nvfp4_kernel,
                    {
                        "x_ptr": "*i32",
                        "codes_ptr": "*i32",
                        "sf_ptr": "*u8",
                        "gs_ptr": "*fp32",
                        "amax_ptr": "*i32",
                        "status_ptr": "*i32",
                        "M": "i32",
                        "K": "i32",
                        "x_row_words": "i32",
                        "code_row_words": "i32",
                    },
                    {"IN_KIND": kind, "ROW_SCOPE": row, "ROWS": rows, "CHUNK": chunk, "SINGLE": single, "E4M3_SW": sw},
                    warps,
                )
        yield (
            "mxfp8",
            qt._mxfp8_kernel,
            {"x_ptr": xp, "codes_ptr": "*u8", "scales_ptr": "*u8", "status_ptr": "*i32", "M": "i32", "K": "i32"},
            {"IN_KIND": kind, "ROWS": 1, "CHUNK": 64, "E4M3_SW": False},
            4,
        )
        for g, chunk in ((32, 64), (128, 16)):
            yield (
                f"int4 kind={kind} g={g}",
                qt._int4_kernel,
                {
                    "x_ptr": "*i32",
                    "codes_ptr": "*i16",
                    "scales_ptr": "*bf16",
                    "status_ptr": "*i32",
                    "M": "i32",
                    "K": "i32",
                    "x_row_words": "i32",
                },
                {"IN_KIND": kind, "G": g, "ROWS": 1, "CHUNK": chunk},
                4,
            )
        for gr, bm, bk in ((1, 128, 128), (32, 1, 128)):
            yield (
                f"fp8_block {gr}x{bm}x{bk}",
                qt._fp8_block_kernel,
                {"x_ptr": xp, "codes_ptr": "*u8", "sinv_ptr": "*fp32", "status_ptr": "*i32", "M": "i32", "K": "i32"},
                {"IN_KIND": kind, "GR": gr, "BM": bm, "BK": bk, "E4M3_SW": False},
                8 if gr * bm * bk >= 8192 else 4,
            )
    for pb, maxbp in ((16, 16), (512, 256)):
        yield (
            f"moe_align pb={pb}",
            mt._moe_align_kernel,
            {"ids_ptr": "*i64", "pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_blocks_ptr": "*i32", "P": "i32"},
            {"E": 128, "EP": 256, "PB": pb, "MAXB": maxbp - 7, "MAXBP": maxbp, "BM": 16},
            8,
        )
    for fmt, sptr in ((mt.FMT_NVFP4, "*u8"), (mt.FMT_INT4, "*bf16")):
        for moe in (False, True):
            for asm in (True, False):
                for bn, bk, warps, stages, split in ((32, 256, 2, 3, 4), (64, 256, 4, 3, 1), (64, 128, 2, 2, 8)):
                    yield (
                        f"w4a16 fmt={fmt} moe={moe} asm={asm} cfg={bn},{bk},{warps},{stages},{split}",
                        mt._w4a16_kernel,
                        {
                            "x_ptr": "*bf16",
                            "w_ptr": "*i32",
                            "s_ptr": sptr,
                            "gs_ptr": "*fp32",
                            "y_ptr": "*bf16",
                            "M": "i32",
                            "N": "i32",
                            "K": "i32",
                            "stride_xm": "i32",
                            "stride_ym": "i32",
                            "stride_wn": "i32",
                            "stride_sn": "i32",
                            "pair_ptr": "*i32",
                            "block_expert_ptr": "*i32",
                            "num_blocks_ptr": "*i32",
                            "stride_we": "i32",
                            "stride_se": "i32",
                            "ws_ptr": "*fp32",
                            "lock_ptr": "*i32",
                        },
                        {
                            "FMT": fmt,
                            "G": 32,
                            "MOE": moe,
                            "TOPK": 8,
                            "BN": bn,
                            "BK": bk,
                            "BM": 16,
                            "USE_ASM": asm,
                            "SPLIT": split,
                        },
                        (warps, stages),
                    )


CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass_stats(cubin: bytes) -> tuple[str, int, str]:
    """(registers, SASS instruction count, the five most frequent opcodes) of a cubin, read
    with the cuobjdump that Triton's package carries (static counts: a loop body counts once)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass, re.M)
    top = " ".join(f"{op}:{n}" for op, n in collections.Counter(ops).most_common(5))
    return regs.group(1) if regs else "?", len(ops), top


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ptx", help="write each variant's PTX and SASS-free metadata here")
    ap.add_argument("--only", default="", help="substring filter on variant names")
    ap.add_argument("--sass", action="store_true", help="print registers and SASS instruction counts (cuobjdump)")
    args = ap.parse_args()
    failures = 0
    for name, fn, sig, consts, launch in variants():
        if args.only not in name:
            continue
        warps, stages = (launch, 3) if isinstance(launch, int) else launch
        full_sig = dict(sig)
        for k in consts:
            full_sig[k] = "constexpr"
        t0 = time.time()
        try:
            # As the launcher specializes at run time: 16-byte aligned pointers, and ints that
            # are multiples of 16 (K, strides) marked divisible by 16.
            div16 = {
                (fn.arg_names.index(a),): [["tt.divisibility", 16]]
                for a, t in sig.items()
                if t.startswith("*")
                or a
                in (
                    "K",
                    "x_row_words",
                    "code_row_words",
                    "stride_xm",
                    "stride_ym",
                    "stride_wn",
                    "stride_sn",
                    "stride_we",
                    "stride_se",
                )
            }
            src = ASTSource(fn=fn, signature=full_sig, constexprs=consts, attrs=div16)
            k = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
            md = k.metadata
            regs = getattr(k, "n_regs", None)
            spills = getattr(k, "n_spills", None)
            if regs is None and "cubin" in k.asm:  # older/newer Triton keep these on the loaded kernel only
                regs = spills = "?"
            print(f"ok   {name:70s} {time.time() - t0:5.1f}s shared={md.shared} regs={regs} spills={spills}")
            if args.sass:
                sregs, n_instr, top = sass_stats(k.asm["cubin"])
                print(f"     registers={sregs} sass_instructions={n_instr} top: {top}")
            if args.ptx:
                os.makedirs(args.ptx, exist_ok=True)
                stem = os.path.join(args.ptx, name.replace(" ", "_").replace("=", "").replace(",", "_"))
                with open(stem + ".ptx", "w") as f:
                    f.write(k.asm["ptx"])
                with open(stem + ".cubin", "wb") as f:
                    f.write(k.asm["cubin"])
        except Exception as e:  # report every failing variant, not just the first
            failures += 1
            msg = str(e).strip().splitlines()
            print(f"FAIL {name}: {type(e).__name__}: {' | '.join(msg[-12:])[:3000]}")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
