#!/usr/bin/env bash
# Download the nvidia-cudnn-frontend wheel for the GPU machine (Python 3.12, manylinux x86_64) into the
# git-ignored folder .whl/, so `tools/gpu_run.sh` can install it there (the GPU machine has no network).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-1.32.0}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "nvidia-cudnn-frontend==${VERSION}"
ls -la .whl
