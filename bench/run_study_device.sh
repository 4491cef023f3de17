#!/usr/bin/env bash
# A study on the GPU machine: `tandem study $STUDY` (default configs/study/consistency-gpu.yaml) with
# the packages bench/device_env.sh sets up (redis-server from Debian's packages, redis-py and
# zstandard wheels in $E2E_PKGS or .whl/) under a private MPS daemon (E2E_MPS: auto, 1 or 0), the
# runs in $E2E_DIR/study, then the report, summary.csv and PNGs archived in $OUT/study.tar.gz (one
# file: the device tool brings back only a few).
#   bash bench/run_study_device.sh                          # on the GPU machine, from the repository root
#   STUDY=configs/study/consistency-gpu.yaml JOBS=4 STUDY_ARGS="trainer.max_steps=20" bash bench/run_study_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
TAG=run_study_device
# shellcheck source=bench/device_env.sh
. bench/device_env.sh  # PYTHON, E2E_DIR, E2E_PKGS; device_packages, device_mps
OUT=${OUT:-/tmp/tandem-study-out}
STUDY=${STUDY:-configs/study/consistency-gpu.yaml}
[ -f "$STUDY" ] || { echo "$TAG: no study config $STUDY" >&2; exit 2; }
mkdir -p "$OUT" "$E2E_DIR"
device_packages
device_mps "${E2E_MPS:-auto}"
# shellcheck disable=SC2086
timeout -s INT -k 60 "${STUDY_TIMEOUT:-540}" "$PYTHON" -m tandem.cli study "$STUDY" --out "$E2E_DIR/study" \
  --jobs "${JOBS:-4}" ${STUDY_ARGS:-} 2>&1 | tee "$OUT/study.log"
status=${PIPESTATUS[0]}
(cd "$E2E_DIR/study" && tar -czf "$OUT/study.tar.gz" ./*.md ./*.csv ./*.png study.yaml 2>/dev/null)
exit "$status"
