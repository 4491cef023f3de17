#!/usr/bin/env bash
# megatron-core backend on the CUDA machine: installs the carried megatron-core wheel (.whl/, not in
# git; fetch it with the command below, carry the folder), then runs the GPU parity tests of the
# backend and a forward/backward timing of both backends on the same model. From the repo root:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2      # on a machine with PyPI
#     bash bench/run_megatron_device.sh                                       # on the device
# Logs and bench_megatron.json land in $OUT (default /tmp/tandem-bench).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # prepended: side folders stay visible
OUT=${OUT:-/tmp/tandem-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import megatron.core" 2>/dev/null; then
  # megatron-core needs only torch, numpy and packaging, which the image has: no index, no deps.
  python3 -m pip install --no-index --no-deps .whl/megatron_core-*.whl 2>&1 | tail -1 || exit 1
fi
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" \
  2>/dev/null | tee -a "$OUT/gpu.txt"
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # --noconftest: the shared conftest imports the Redis helpers; the GPU tests need none of them.
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest tests/gpu/test_megatron_backend.py --noconftest -q -s \
    -p no:cacheprovider 2>&1 | tee "$OUT/megatron_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/bench_megatron.py ${BENCH_ARGS:-} --json "$OUT/bench_megatron.json" \
    2>&1 | grep -v -i "warn" | tee "$OUT/bench_megatron.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
