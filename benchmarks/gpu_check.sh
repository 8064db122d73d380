#!/usr/bin/env bash
# The GPU check for a lent machine that has CUDA torch but neither megatron-core nor TE.
# Prepare here, once:   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
# Then run this script there with `.whl` carried. Prints parity, step time, MFU; writes
# benchmarks/results/gpu_check.json. Arguments go to benchmarks/gpu_check.py, e.g.
# `--sections kernels` for only the attention-kernel checks (TE BF16/FP8, flash-attn: each runs
# where installed and is reported as skipped, with the reason, where not).
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -m benchmarks.gpu_check "$@"
