#!/usr/bin/env bash
# Everything that needs the GPU machine, in one call (its device time is scarce): the kernel, model and
# worker tests compiled on CUDA, then the dispatch and attention benchmarks. From the repo root, with
# .whl/ carried (../shared/device/make-wheels.sh builds it):
#   bash bench/gpu_run.sh            # logs go to $OUT (or ./out)
set -o pipefail
. bench/gpu_setup.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== tests (compiled Triton on CUDA)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/model tests/worker 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
echo "== dispatch: compiled graphs vs actor calls"
timeout 150 python3 bench/bench_dispatch.py --shards 1 2 4 --gpus-per-shard 0.25 --iters 2000 2>&1 \
  | tee "$OUT/dispatch.log" | tail -12
echo "== paged attention"
timeout 90 python3 bench/bench_attention.py --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -14
