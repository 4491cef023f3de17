#!/usr/bin/env bash
# The trainer's backends on the CUDA machine: the GPU tests of both backends (tests/gpu/
# test_grouped_gpu.py, test_megatron_backend.py, test_trainer_gpu.py), then bench/bench_trainer.py for torch and
# megatron-core, plain bf16 and QAT, then bench/bench_versions.py (the mismatch split's older-version
# forward). megatron-core comes as a carried wheel (see bench/run_megatron_device.sh for how to fetch
# it); install it on PYTHONPATH first. From the repo root:
#     OUT=/tmp/out bash bench/run_trainer_device.sh
# Logs land in $OUT (default /tmp/tandem-bench). BENCH_ARGS replaces the benchmark's arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tandem-bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)" \
  2>/dev/null | tee -a "$OUT/gpu.txt"
status=0
# --noconftest: the shared conftest imports the Redis helpers; the GPU tests need none of them.
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest --noconftest -q -s -p no:cacheprovider -W ignore \
  tests/gpu/test_grouped_gpu.py tests/gpu/test_megatron_backend.py tests/gpu/test_trainer_gpu.py 2>&1 \
  | tee "$OUT/trainer_tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-170}" python3 -W ignore bench/bench_trainer.py \
  ${BENCH_ARGS:---layers 6 --batch 4 --seq 1024 --steps 2 --warmup 1 --backends torch,megatron --no-publish} \
  2>&1 | tee "$OUT/bench_trainer.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# The mismatch split's forward under an older version, the long workload's shapes (docs/benchmarks.md).
timeout "${VERSIONS_TIMEOUT:-150}" python3 -W ignore bench/bench_versions.py --device cuda --preset qwen3-30b-a3b \
  --layers 6 --rows 32 --row-len 1100 --microbatch-tokens 4096 --repeats 3 2>&1 | tee "$OUT/bench_versions.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
