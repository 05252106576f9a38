#!/usr/bin/env bash
# The GPU check of issue 20 on one GPU, in under 10 minutes: installs vLLM if it is missing,
# then runs benchmarks/gpu_check.py (see its docstring) and keeps its summary.
#   bash benchmarks/gpu_check.sh            # on a GPU host, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: CPU, small sizes, no vLLM
# Extra arguments go to gpu_check.py. Output: results/gpu_check.json and results/gpu_check.log
# (under $OUT instead when it is set, as on the device machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ " $* " != *" --dry-run "* ]]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null || {
    echo "gpu_check.sh: torch sees no CUDA GPU here (run with --dry-run on a CPU host)" >&2
    exit 2
  }
  if ! "$PY" -c 'import vllm' 2>/dev/null; then
    # vLLM brings its own CUDA build of torch; a failed install still runs the rest
    echo "gpu_check.sh: installing vllm (pip) ..."
    timeout 300 "$PY" -m pip install -q --retries 1 --timeout 20 "vllm>=0.33" 2>&1 | tail -3 || \
      echo "gpu_check.sh: pip install vllm failed: the chain will run vLLM's worker-side apply only"
  fi
  "$PY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
timeout 540 "$PY" benchmarks/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
