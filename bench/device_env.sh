# Sourced by bench/run_e2e_device.sh and bench/run_study_device.sh from the repository root, first:
# what a `tandem run` needs on a machine without internet (the H200 image), from Debian packages and
# wheels in $E2E_PKGS or .whl/, and a private NVIDIA MPS daemon. Sets the defaults below; the
# functions also use $OUT, and their messages start with $TAG.
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
E2E_DIR=${E2E_DIR:-/tmp/tandem-e2e}
E2E_PKGS=${E2E_PKGS:-../.extra18}

_install() {  # module $1 importable, else the wheel $2-*.whl of $E2E_PKGS or .whl/ installed into
  # /tmp/tandem-site (on PYTHONPATH once); exit 2 naming it when there is none
  "$PYTHON" -c "import $1" 2>/dev/null && return
  local whl
  whl=$(ls "$E2E_PKGS"/"$2"-*.whl .whl/"$2"-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "$TAG: $1 is missing (no $2-*.whl in $E2E_PKGS or .whl/)" >&2; exit 2; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/tandem-site "$whl" || exit 1
  case ":${PYTHONPATH:-}:" in *:/tmp/tandem-site:*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/tandem-site ;; esac
}

# redis-server (Debian's packages unpacked with `dpkg -x` when none is on PATH), redis-py and
# zstandard, and megatron-core when $1 is "megatron"; then the versions into $OUT/versions.txt.
device_packages() {
  if ! command -v redis-server >/dev/null 2>&1; then
    local root=/tmp/tandem-redis-root f
    mkdir -p "$root/bin"
    for f in "$E2E_PKGS"/*.deb; do dpkg -x "$f" "$root" || exit 1; done
    # A wrapper keeps LD_LIBRARY_PATH out of every other process; argv[0] must end in redis-server
    # (Debian's redis-server is a link to redis-check-rdb, which acts on the name it is called by).
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/usr/lib/x86_64-linux-gnu exec %s/usr/bin/redis-server "$@"\n' \
      "$root" "$root" > "$root/bin/redis-server"
    chmod +x "$root/bin/redis-server"
    export PATH=$root/bin:$PATH
  fi
  redis-server --version || { echo "$TAG: redis-server does not run" >&2; exit 1; }
  _install redis redis
  _install zstandard zstandard  # delta versions
  if [ "${1:-}" = megatron ]; then _install megatron.core megatron_core; fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  "$PYTHON" -c "import grpc, google.protobuf, torch, redis; print('torch', torch.__version__, 'grpcio', grpc.__version__, \
'protobuf', google.protobuf.__version__, 'redis-py', redis.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/versions.txt"
  fi
}

# A private MPS control daemon (pipe and log folders under $E2E_DIR), stopped when the script exits,
# if the machine has one and a CUDA process runs under it; $1: auto, 1 (an error without) or 0 (none).
# Sets mps=on|off.
device_mps() {
  mps=off
  if [ "$1" != 0 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY=$E2E_DIR/mps-pipe CUDA_MPS_LOG_DIRECTORY=$E2E_DIR/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d && "$PYTHON" -c "import torch; torch.ones(1, device='cuda').sum().item()"; then
      mps=on
      trap 'echo quit | nvidia-cuda-mps-control' EXIT
    else
      echo quit | nvidia-cuda-mps-control 2>/dev/null
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  fi
  if [ "$mps" = off ] && [ "$1" = 1 ]; then echo "$TAG: MPS required (1) but no MPS daemon runs here" >&2; exit 1; fi
  echo "mps: $mps" | tee -a "$OUT/versions.txt"
}
