#!/usr/bin/env bash
# Issue 29: the wheels the project's GPU host lacks, downloaded here for its python.
#
# The GPU host (one H200; python 3.12, torch 2.11 + CUDA 13, transformers, numba, msgpack,
# safetensors, numpy, pyyaml, pandas) has no network and no zstandard, blake3 or cryptography,
# which `aurora.delta` and `aurora.keys` import. This fetches their CPython 3.12 manylinux x86_64
# wheels and their dependencies (cffi, pycparser) into wheels/gpu-host/ (git-ignored; about
# 12 MB, under the 64 MiB a device run may carry); benchmarks/gpu_check.sh installs them there
# with `pip install --no-index --find-links`. The versions are the ones the test suite runs with.
#   bash benchmarks/gpu_host_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-wheels/gpu-host}"
mkdir -p "$dest"
PY="${PYTHON:-python3}"
pyver="${GPU_HOST_PYTHON:-3.12}"  # the GPU host's python (another, to dry-run this elsewhere)
"$PY" -m pip download --quiet --disable-pip-version-check \
  --only-binary=:all: --implementation cp --python-version "$pyver" --abi "cp${pyver//./}" --abi abi3 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$dest" "zstandard==0.25.0" "blake3==1.0.11" "cryptography==48.0.0"
ls -l "$dest"
du -sh "$dest"
