#!/usr/bin/env bash
# The GPU check (issues 20, 24, 29) on one GPU, in under 8 minutes: benchmarks/gpu_check.py (see
# its docstring) with what the host lacks brought in first, and its summary kept.
#   bash benchmarks/gpu_check.sh              # a CUDA GPU with vLLM: vLLM must run, or FAIL
#   bash benchmarks/gpu_check.sh --no-vllm    # a CUDA GPU without vLLM: the torch parts
#   bash benchmarks/gpu_check.sh --dry-run    # anywhere: CPU, small sizes, no vLLM
# Extra arguments go to gpu_check.py. Output: results/gpu_check.json and results/gpu_check.log
# (under $OUT instead when it is set, as on the device machine).
#
# Nothing is downloaded on a host without network: zstandard, blake3 and cryptography, when
# missing, come from wheels/gpu-host/ (benchmarks/gpu_host_wheels.sh, run beforehand on a
# machine with network) and are installed with `pip install --no-index` into a private
# directory; vLLM is installed only where pypi.org is reachable, and a run that asked for vLLM
# without it fails at once instead of passing without it.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
wheels="${AURORA_WHEELS:-wheels/gpu-host}"

online() {
  "$PY" -c 'import socket; socket.create_connection(("pypi.org", 443), timeout=3).close()' \
    2>/dev/null
}
net=yes
if ! online; then
  net=no
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # nothing may try the network either
  echo "gpu_check.sh: no network here (pypi.org:443 unreachable): nothing will be downloaded"
fi

# the project's own imports the host may lack (the GPU host's image has none of the three)
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in
  ("zstandard", "blake3", "cryptography") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
  if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "gpu_check.sh: FAIL: $missing not installed and no wheels in $wheels" \
      "(run benchmarks/gpu_host_wheels.sh on a machine with network and carry $wheels)" >&2
    exit 2
  fi
  site="${TMPDIR:-/tmp}/aurora-gpu-site"
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086  # $missing is a list of names
  if ! PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --quiet --disable-pip-version-check \
    --no-index --find-links "$wheels" --target "$site" $missing; then
    # no usable pip there: a wheel is a zip of its installed files, so unpack them all
    echo "gpu_check.sh: pip could not install from $wheels; unpacking the wheels into $site"
    mkdir -p "$site"
    for w in "$wheels"/*.whl; do "$PY" -m zipfile -e "$w" "$site"; done
  fi
  export PYTHONPATH="$PYTHONPATH:$site"
  echo "gpu_check.sh: installed $missing from $wheels in" \
    "$("$PY" -c "import time; print(round(time.time() - $t0, 1))") s"
fi

if [[ " $* " != *" --dry-run "* ]]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || {
    echo "gpu_check.sh: torch sees no CUDA GPU here (run with --dry-run on a CPU host)" >&2
    exit 2
  }
  if [[ " $* " != *" --no-vllm "* ]] && ! "$PY" -c 'import vllm' 2>/dev/null; then
    if [ "$net" = no ]; then
      echo "gpu_check.sh: FAIL: vLLM is not installed and this host has no network to install" \
        "it; rerun with --no-vllm for the torch parts" >&2
      exit 2
    fi
    # vLLM brings its own CUDA build of torch; gpu_check.py fails if it still cannot import it
    echo "gpu_check.sh: installing vllm (pip) ..."
    timeout 300 "$PY" -m pip install -q --retries 1 --timeout 20 "vllm>=0.33,<0.35" 2>&1 |
      tail -3 || true
  fi
  "$PY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
timeout 480 "$PY" benchmarks/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 |
  tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
