#!/usr/bin/env bash
# One device call for a session short of device time (2026-12-07): the GPU tests of the decode path and
# the pipelined Ray dispatch, the decode step in-process against Ray (bench_backends.py), and Gemma-3-4B's
# decode step (b64/4k) for the working tree and the tree in .before/ (bench/ab_before_after.sh --export REV);
# on an H200, Gemma first; on another GPU the tests only, unless FULL=1.
# Carry [".whl", ".before"]. Every part is cut to the time left of LIMIT seconds (default 570).
. bench/gpu_setup.sh || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-570}
left() { local t=$((LIMIT - SECONDS)); echo $((t > 1 ? t : 1)); }  # timeout 0 would mean none
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
gpu_tests() {
  timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m pytest -q -rfE -p no:cacheprovider -p no:benchmark \
    -n 8 --timeout 100 tests/worker/test_block_tables.py tests/kernels/test_token_history.py \
    tests/worker/test_decode_graph_path.py tests/worker/test_cudagraph_gpu.py \
    tests/scheduler/test_pipelined_dispatch.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
  echo "(tests: $SECONDS s)"
}
qwen_part() {  # Qwen3-8B's decode step (b64/4k) for the working tree only
  timeout $(left) python3 bench/bench_hf_models.py --shape qwen3-8b --root /tmp/hf_ckpt --skip-exactness 2>&1 \
    | grep -v "Loading weights" | tail -2
  echo "(qwen checkpoint: $SECONDS s)"
  [ "$(left)" -gt 60 ] && timeout $(left) python3 bench/bench_decode.py --model /tmp/hf_ckpt/qwen3-8b --batch 64 \
    --context 4096 --steps 32 --configs "graphs + async" 2>&1 | tee "$OUT/qwen.log" | grep -E "^decode|floor"
  echo "(qwen: $SECONDS s)"
}
gemma() {  # gemma LABEL [before]: one bench_decode process
  local dir=. env=""
  if [ "$2" = before ]; then ln -sfn ../kernels .before/raystate/kernels; dir=.before; env="PYTHONPATH=$PWD/.before${PYTHONPATH:+:$PYTHONPATH}"; fi
  (cd $dir && timeout $(left) env $env python3 bench/bench_decode.py --model /tmp/hf_ckpt/gemma3-4b --batch 64 \
    --context 4096 --steps 32 --configs "graphs + async" 2>&1 | tee "$OUT/gemma_$1.log" \
    | grep -E "^decode|floor|GPU per step|host")
  echo "($1: $SECONDS s)"
}
backends() {
  timeout $(left) python3 bench/bench_backends.py --batches 1 8 64 --rounds 1 --json "$OUT/backends.json" 2>&1 \
    | tee "$OUT/backends.log" | grep -vE "^\(|^\[" | tail -10
  echo "(backends: $SECONDS s)"
}
gemma_part() {
  timeout $(left) python3 bench/bench_hf_models.py --shape gemma3-4b --root /tmp/hf_ckpt --skip-exactness 2>&1 \
    | grep -v "Loading weights" | tail -2
  echo "(checkpoint: $SECONDS s)"
  [ "$(left)" -gt 60 ] && gemma after_1
  [ "$(left)" -gt 60 ] && gemma before_1 before
}
# On an H200 Gemma's figure (issue 15's goal) comes first, then the tests and the backends bench;
# elsewhere the tests only (FULL=1: then the backends bench and Gemma too; H200_ONLY=1: nothing; QWEN=1:
# Qwen3-8B's decode step), to spare device time.
if grep -q H200 "$OUT/gpu.txt"; then gemma_part; gpu_tests; backends
elif [ "${H200_ONLY:-0}" = 1 ]; then echo "not an H200: nothing run (H200_ONLY=1)"
elif [ "${QWEN:-0}" = 1 ]; then qwen_part
elif [ "${FULL:-0}" = 1 ]; then gpu_tests; backends; gemma_part
else gpu_tests; fi
exit 0
