#!/usr/bin/env bash
# Tandem end to end on one GPU: `tandem run configs/gpu-h200.yaml` (trainer + 2 rollout
# workers + a private redis-server, policy gRPC on loopback) for a bounded number of steps, then
# the same synchronously (loop.max_staleness=0) and with the bf16 recipe; one report.
# RUNS names the runs (default "async sync bf16"): async, sync, bf16, megatron (the async run
# with trainer.backend=megatron: the megatron-core GPTModel trainer, CUDA only) and async_sm (the
# async run with the trainer's kernels held to E2E_TRAINER_SM percent of the SMs, default 70, under MPS;
# async_sm30, async_sm50, ...: that percentage),
# async_low (the async run with the trainer below the workers in MPS's scheduling:
# trainer.mps_client_priority=1), async_hi (the workers' generation on a high-priority CUDA stream:
# rollout.decode_priority=high) and inflight (the async run with loop.inflight_updates=true:
# versions swap between decode steps). E2E_ARGS: more overrides for every run.
#
#   bash bench/run_e2e_device.sh                     # on the GPU machine, from the repository root
#   RUNS="async sync" STEPS=12 bash bench/run_e2e_device.sh
#   RUNS="async megatron" bash bench/run_e2e_device.sh
#   E2E_SMALL=1 bash bench/run_e2e_device.sh         # CPU dry run of the same path: tiny model, 3 steps
#   E2E_MPS=0 bash bench/run_e2e_device.sh           # no NVIDIA MPS daemon (default: one if the machine has it)
#   E2E_TRACE_AFTER_S=120 bash bench/run_e2e_device.sh   # each worker profiles 20 steps 120 s in (rollout.trace),
#                                                    # the trainer its next step (trainer.trace):
#                                                    # <run>/traces/<name>-trace.json and -trace-summary.json
#                                                    # (the trainer's trace.json, large, stays out of the archive)
#
# MPS (E2E_MPS, default auto): without it the trainer's and the workers' CUDA contexts time-slice the
# GPU (one context's kernels at a time), and a worker's stream of small decode kernels costs the
# trainer most of its step (docs/benchmarks.md). With an MPS control daemon (nvidia-cuda-mps-control,
# part of the NVIDIA driver utilities) the processes' kernels share the SMs at once. The script starts
# a private daemon (its pipe and log folders under $E2E_DIR), checks that a CUDA process runs under
# it, and stops it when it exits; E2E_MPS=1 makes a missing or failing daemon an error.
#
# What it needs besides the checkout (a machine without internet, e.g. the H200 image, which has
# torch, triton, grpcio, protobuf, msgpack, xxhash, uvloop, tokenizers, safetensors, prometheus-client):
#   - redis-server 7.0+ on PATH, or Debian 12's packages in $E2E_PKGS (default ../.extra18), unpacked
#     here with `dpkg -x` (the binary runs on Ubuntu 24.04 with LD_LIBRARY_PATH pointing at them):
#       apt-get update && apt-get download redis-server redis-tools libjemalloc2 liblzf1
#     (redis-server 7.0.15-1~deb12u10, redis-tools of the same version, libjemalloc2 5.3.0-1, liblzf1 3.6-3);
#   - redis-py, if `import redis` fails: redis-8.1.0-py3-none-any.whl in $E2E_PKGS
#       (pip download --no-deps redis==8.1.0);
#   - zstandard, if `import zstandard` fails: its cp312 manylinux wheel in $E2E_PKGS or .whl/
#       (pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 zstandard);
#   - grpcio-health-checking, if missing: its wheel, installed before this script (the device
#     tool's .whl folder); grpcio-reflection is not needed (the config turns reflection off);
#   - for the megatron run, megatron-core if `import megatron.core` fails: megatron_core-*.whl in
#     $E2E_PKGS or .whl/ (pip download --no-deps --only-binary=:all: --python-version 3.12
#     --platform manylinux_2_28_x86_64 megatron-core==0.19.2; it needs only torch, numpy, packaging).
# Writes the HF folder (bench/make_e2e_model.py: random init + a short warm start; reused when up to
# date), runs each of $RUNS into $E2E_DIR/<run>, samples the GPU (nvidia-smi: utilization every
# 200 ms, memory per process every 2 s), then bench/e2e_report.py. $OUT gets report.md,
# report.json and <run>.tar.gz per run (its metrics.jsonl, audit.jsonl, config.yaml, plots, logs,
# GPU samples and the model's tandem_e2e.json), written as each run ends; the device tool brings
# back only a few files, hence the archives.
set -uo pipefail
cd "$(dirname "$0")/.."
TAG=run_e2e_device
# shellcheck source=bench/device_env.sh
. bench/device_env.sh  # PYTHON, E2E_DIR, E2E_PKGS; device_packages, device_mps
OUT=${OUT:-/tmp/tandem-e2e-out}
RUNS=${RUNS:-async sync bf16}
RUN_TIMEOUT=${RUN_TIMEOUT:-420}   # seconds per run at most
BUDGET_S=${BUDGET_S:-0}           # > 0: the whole script's seconds; runs are cut (SIGINT) to end within it
T0=$(date +%s)
for run in $RUNS; do
  case $run in async|sync|bf16|megatron|async_sm|async_sm[1-9]|async_sm[1-9][0-9]|async_sm100|async_low|async_hi|inflight) ;; *) echo "run_e2e_device: unknown run $run in RUNS (async, sync, bf16, megatron, async_sm, async_smNN, async_low, async_hi, inflight)" >&2; exit 2 ;; esac
done
mkdir -p "$OUT" "$E2E_DIR"
CONFIG=${E2E_CONFIG:-configs/gpu-h200.yaml}  # configs/gpu-h200-long.yaml: ~1,024-token completions
if [ "${E2E_SMALL:-0}" = 1 ]; then  # the same launch path on the CPU with a tiny model
  STEPS=${STEPS:-3}
  MODEL=${MODEL:-$E2E_DIR/model-tiny}
  MAKE_ARGS=(--preset tiny --layers 2 --override shared_expert_ffn_dim=0 --warmstart-steps 30 --warmstart-lr 3e-3
             --warmstart-warmup 3 --eval-prompts 256 --device cpu)  # 256: reward > 0 beyond doubt
  DEVICE_ARGS=(trainer.device=cpu rollout.device=cpu trainer.memory_fraction=0 rollout.memory_fraction=0
               task.max_new_tokens=6 model.overrides.max_seq_len=64 trainer.collect_timeout_s=120)
else
  STEPS=${STEPS:-8}
  MODEL=${MODEL:-$E2E_DIR/model-qwen3-30b-a3b-6l}
  MAKE_ARGS=(--layers "${LAYERS:-6}")
  DEVICE_ARGS=()
fi

# --- packages: redis-server, redis-py, zstandard, megatron-core (bench/device_env.sh) ---------------
if [[ " $RUNS " == *" megatron "* ]] && [ "${E2E_SMALL:-0}" != 1 ]; then device_packages megatron; else device_packages; fi

# --- the model ------------------------------------------------------------------------------------
"$PYTHON" bench/make_e2e_model.py --config "$CONFIG" --out "$MODEL" "${MAKE_ARGS[@]}" 2>&1 | tee "$OUT/make_model.log"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

# --- NVIDIA MPS (E2E_MPS: auto, 1 or 0; never for the CPU dry run) ---------------------------------
if [ "${E2E_SMALL:-0}" = 1 ]; then device_mps 0; else device_mps "${E2E_MPS:-auto}"; fi

# --- the runs -------------------------------------------------------------------------------------
gpu_procs() {  # memory per process every 2 s, by role (trainer / --worker-id wN), until killed
  while sleep 2; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      while IFS=', ' read -r pid mem; do
        role=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -o 'trainer\|--worker-id [^ ]*' | head -1)
        echo "$(date +%s),${role:-pid $pid},$mem"
      done
  done
}
status=0
for run in $RUNS; do
  case $run in
    async) extra=() ;;
    sync) extra=(loop.max_staleness=0) ;;
    bf16) extra=(recipe=bf16) ;;
    megatron) extra=(trainer.backend=megatron) ;;
    async_sm) extra=(trainer.mps_thread_percentage="${E2E_TRAINER_SM:-70}") ;;
    async_sm*) extra=(trainer.mps_thread_percentage="${run#async_sm}") ;;
    async_low) extra=(trainer.mps_client_priority=1) ;;
    async_hi) extra=(rollout.decode_priority=high) ;;
    inflight) extra=(loop.inflight_updates=true) ;;
  esac
  # shellcheck disable=SC2206
  extra+=(${E2E_ARGS:-})
  if [ "$run" = megatron ] && [ "${E2E_SMALL:-0}" = 1 ]; then
    echo "=== megatron: skipped (E2E_SMALL runs on the CPU; the megatron backend needs CUDA)"; continue
  fi
  dir=$E2E_DIR/$run
  limit=$RUN_TIMEOUT
  if [ "$BUDGET_S" -gt 0 ]; then
    left=$(( BUDGET_S - ($(date +%s) - T0) - 25 ))  # 25 s for the report and the archives
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 60 ]; then echo "=== $run: skipped, ${left}s of BUDGET_S left"; continue; fi
  fi
  # `tandem run` refuses a non-empty folder that is not a run folder: what the script writes beside the
  # run goes into $side until the run is over, then into the run folder.
  side=$E2E_DIR/$run.side
  rm -rf "$dir" "$side" && mkdir -p "$side"
  if [ -n "${E2E_TRACE_AFTER_S:-}" ]; then
    extra+=(rollout.trace.dir="$side/traces" rollout.trace.after_s="$E2E_TRACE_AFTER_S"
            trainer.trace.dir="$side/traces" trainer.trace.after_s="$E2E_TRACE_AFTER_S" trainer.trace.steps=1)
  fi
  samplers=()
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 |
      while IFS= read -r line; do echo "$(date +%s.%N),$line"; done > "$side/gpu_util.csv" &
    samplers+=($!)
    gpu_procs > "$side/gpu_procs.csv" &
    samplers+=($!)
  fi
  echo "=== $run: tandem run $CONFIG trainer.max_steps=$STEPS ${extra[*]} ${DEVICE_ARGS[*]}"
  start=$(date +%s)
  timeout -s INT -k 60 "$limit" "$PYTHON" -m tandem.cli run "$CONFIG" --run-dir "$dir" model.checkpoint="$MODEL" \
    trainer.max_steps="$STEPS" "${extra[@]}" "${DEVICE_ARGS[@]}" 2>&1 | tee "$side/launcher.log"
  rc=${PIPESTATUS[0]}
  for p in "${samplers[@]}"; do kill "$p" 2>/dev/null; done  # nvidia-smi then ends on its closed pipe
  mkdir -p "$dir" && mv "$side"/* "$dir"/ && rmdir "$side"
  steps=$(wc -l < "$dir/metrics.jsonl" 2>/dev/null || echo 0)
  echo "=== $run: exit $rc after $(( $(date +%s) - start )) s (limit ${limit} s), $steps step(s)"
  # A run cut at its time limit (timeout's 124) after a step or more is bounded, not failed.
  if [ "$rc" = 124 ] && [ "$steps" -gt 0 ]; then echo "=== $run: cut at its time limit"; elif [ "$rc" != 0 ]; then status=1; fi
  cp "$MODEL/tandem_e2e.json" "$dir/model.json"
  # shellcheck disable=SC2086
  tar -czf "$OUT/$run.tar.gz" -C "$E2E_DIR" --exclude=redis --exclude=checkpoints --exclude=run.secret \
    --exclude=trainer-trace.json "$run"
done

# --- report ---------------------------------------------------------------------------------------
dirs=()
for run in $RUNS; do [ -d "$E2E_DIR/$run" ] && dirs+=("$E2E_DIR/$run"); done
if [ "${#dirs[@]}" = 0 ]; then echo "run_e2e_device: no run made, no report"; exit $status; fi
"$PYTHON" bench/e2e_report.py "${dirs[@]}" --sync sync --json "$OUT/report.json" | tee "$OUT/report.md"
exit $status
