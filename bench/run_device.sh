#!/usr/bin/env bash
# Reproduces every device number of the "H200 kernels" section of docs/benchmarks.md and runs
# the GPU parity tests. Run on the CUDA machine from the repo root:
#     bash bench/run_device.sh            # tests + benchmark (fixed configs)
#     BENCH_ARGS=--tune bash bench/run_device.sh   # also search matmul configs first
#     ENGINE_BENCH=1 bash bench/run_device.sh       # also the rollout engine (bench/bench_engine.py)
#     TRAINER_BENCH=1 bash bench/run_device.sh      # also the trainer step and publish (bench_trainer/bench_publish)
#     EXACT_BENCH=1 bash bench/run_device.sh        # also exact mode's cost on CUDA (bench_exact.py --device cuda)
#     MOE_TUNE=1 bash bench/run_device.sh           # also the MoE config sweep (bench/tune_moe.py)
#     ATTN_BENCH=1 bash bench/run_device.sh         # also decode attention / sampling vs FlashInfer (needs flashinfer)
# Logs and bench.json land in $OUT (default /tmp/tandem-bench).
set -uo pipefail
cd "$(dirname "$0")/.."
# Prepended: wheels installed to a side folder on PYTHONPATH (pip install --target DIR) stay visible.
# tests/: the helpers the tests import (tests/drive_worker.py), found through conftest.py elsewhere.
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tandem-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# Every optional package tests/gpu skips without (pytest.importorskip): found (version, folder) or missing.
# shellcheck disable=SC2046
python3 - $(grep -ho 'importorskip("[^"]*")' tests/gpu/*.py | cut -d'"' -f2 | sort -u) <<'PY' | tee "$OUT/packages.txt"
import importlib, importlib.metadata as md, os, sys
dists = md.packages_distributions()
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
    except Exception as e:  # any failure to import skips the tests, as a missing package does
        print(f"optional package {name}: missing ({type(e).__name__}: {e}); the tests that need it skip")
        continue
    where = os.path.dirname(m.__file__ or "?")
    for _ in range(name.count(".") + (os.path.basename(m.__file__ or "") == "__init__.py")):
        where = os.path.dirname(where)
    owners = set(dists.get(name.split(".")[0], []))  # the version of the copy imported, from its folder
    versions = {d.version for d in md.distributions(path=[where]) if d.metadata["Name"] in owners}
    print(f"optional package {name}: found, {' '.join(versions) or getattr(m, '__version__', '?')} in {where}")
PY
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # --noconftest: the shared conftest imports the Redis helpers, which this image lacks; the
  # GPU tests need none of its fixtures.
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest tests/gpu --noconftest -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-420}" python3 bench/bench_kernels.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${ENGINE_BENCH:-0}" = 1 ]; then  # the packed rollout engine (docs/benchmarks.md, bench_engine.py)
  timeout "${ENGINE_TIMEOUT:-420}" python3 bench/bench_engine.py --json "$OUT/engine.json" 2>&1 | tee "$OUT/engine.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${TRAINER_BENCH:-0}" = 1 ]; then  # the trainer step and publish (bench_trainer.py, bench_publish.py)
  timeout "${TRAINER_TIMEOUT:-300}" python3 bench/bench_trainer.py ${TRAINER_ARGS:-} 2>&1 | tee "$OUT/trainer.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  timeout "${PUBLISH_TIMEOUT:-200}" python3 bench/bench_publish.py ${PUBLISH_ARGS:---bytes 8e9} 2>&1 | tee "$OUT/publish.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${EXACT_BENCH:-0}" = 1 ]; then  # exact mode on CUDA against the default (bench_exact.py)
  # shellcheck disable=SC2086
  timeout "${EXACT_TIMEOUT:-300}" python3 bench/bench_exact.py --device cuda ${EXACT_ARGS:-} 2>&1 | tee "$OUT/exact.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${MOE_TUNE:-0}" = 1 ]; then  # MoE configs, persistent or not, against grouped bf16 (tune_moe.py)
  timeout "${MOE_TIMEOUT:-420}" python3 bench/tune_moe.py --json "$OUT/tune_moe.json" 2>&1 | tee "$OUT/tune_moe.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "${ATTN_BENCH:-0}" = 1 ]; then  # the engine's decode attention and sampler against FlashInfer's
  timeout "${ATTN_TIMEOUT:-240}" python3 bench/bench_attention.py --sampling --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
