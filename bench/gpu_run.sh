#!/usr/bin/env bash
# Everything that needs the GPU machine (one H200), in one call: the CUDA tests, then every GPU benchmark,
# logs, JSON and plots into $OUT (or ./out). From the repo root, with .whl/ carried
# (../shared/device/make-wheels.sh builds it):
#   bash bench/gpu_run.sh [tests|split_tests|pdl_tests|kv_auto|dispatch|attention|attention_split|fixed_cost|attention_tests|ncu_attention|blas|blas_layouts|gemm|kernels|pdl|decode|decode_small|logprobs|prefix|throughput|hf|hf_blas|hf_pdl|serve_profile|serve_replicas|cold ...]
#   (default: all but hf, cold, decode_small and logprobs)
set -o pipefail
. bench/gpu_setup.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
parts=${*:-tests dispatch attention gemm kernels decode prefix throughput}

# bench_decode once per comma-separated configuration, each in its own process: a configuration run after
# another in one process measured 0.3 ms (3.5%) slower than alone (BENCHMARKS.md, "Where the rest of the
# step goes"). ROUNDS=2 runs the list twice. Usage: each_config "label,label" SECONDS bench_decode args...
each_config() {
  local labels=$1 limit=$2 list c round
  shift 2
  IFS=',' read -ra list <<< "$labels"
  for round in $(seq "${ROUNDS:-1}"); do
    for c in "${list[@]}"; do
      timeout "$limit" python3 bench/bench_decode.py "$@" --configs "$c"
    done
  done
}
for part in $parts; do
  echo "== $part"
  case $part in
    tests)  # compiled Triton kernels on CUDA, the model and the worker, the engine's GPU tests; 16 processes
      # (pytest-xdist is on the GPU machine): compiling the kernels for every test shape is most of the time;
      # 300 s a test (the largest attention tile test needed over 170 s on 2026-12-03)
      timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rfE --durations=12 -p no:cacheprovider -p no:benchmark -n 16 \
        --timeout ${TEST_TIMEOUT:-300} tests/kernels tests/model tests/worker tests/engine/test_engine_profile.py \
        tests/engine/test_request_isolation.py tests/engine/test_kv_auto_size.py 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -30 ;;
    split_tests)  # the split-KV kernels compiled, alone: a quick check
      timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -rfE --durations=5 -p no:cacheprovider -p no:benchmark -n 16 \
        --timeout ${TEST_TIMEOUT:-150} tests/kernels/test_attention_split.py 2>&1 \
        | tee "$OUT/gpu_tests_split.log" | tail -12 ;;
    kv_auto)  # the KV cache sized from the GPU's real memory (gpu_memory_utilization 0.9, then 0.5), both backends
      timeout 420 python3 bench/check_kv_auto.py --model bench --shares 0.9 0.5 --backends inprocess ray ray2 2>&1 \
        | tee "$OUT/kv_auto.log" | grep -vE "^\(|INFO|WARNING" | tail -20 ;;
    dispatch)
      timeout 150 python3 bench/bench_dispatch.py --shards 1 2 4 --gpus-per-shard 0.25 --iters 2000 2>&1 \
        | tee "$OUT/dispatch.log" | tail -8 ;;
    attention)
      timeout 300 python3 bench/bench_attention.py --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -40 ;;
    attention_split)  # read floors, split-KV cases (split count x key step x stages, PDL combine on/off), Gemma's heads
      timeout 300 python3 bench/bench_attention.py --split-only --split-tune --json "$OUT/attention_split.json" 2>&1 \
        | tee "$OUT/attention_split.log" | tail -60 ;;
    fixed_cost)  # a batch-64 decode launch's fixed cost over windows: PDL on/off, after the rotation kernel, a plain read
      timeout ${FIXED_TIMEOUT:-300} python3 bench/bench_attention.py --fixed-cost --json "$OUT/attention_fixed_cost.json" 2>&1 \
        | tee "$OUT/attention_fixed_cost.log" | tail -40 ;;
    attention_tests)  # the attention kernels compiled (one-launch, split) and the decode graph path
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rfE --durations=5 -p no:cacheprovider -p no:benchmark -n 16 \
        --timeout ${TEST_TIMEOUT:-250} tests/kernels/test_attention.py tests/kernels/test_attention_split.py \
        tests/worker/test_decode_graph_path.py tests/worker/test_cudagraph_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests_attention.log" | tail -12 ;;
    ncu_attention)  # Nsight Compute on one batch-64 decode attention launch of Gemma's heads (W 1024, full 4k)
      for w in 1024 0; do
        timeout 150 ncu --clock-control none --kernel-name regex:_paged_attention --launch-skip 3 --launch-count 1 \
          --set full -f -o "$OUT/ncu_attention_w$w" python3 bench/ncu_attention.py --window $w 2>&1 | tail -3
        ncu --import "$OUT/ncu_attention_w$w.ncu-rep" --page details > "$OUT/ncu_attention_w$w.txt" 2>&1
        grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" \
          "$OUT/ncu_attention_w$w.txt" | head -20
      done ;;
    blas)  # the decode projections under cuBLAS and cuBLASLt
      timeout 200 python3 bench/bench_blas.py --json "$OUT/blas.json" 2>&1 | tee "$OUT/blas.log" | tail -40 ;;
    blas_layouts)  # the projections with the weight as stored ([N, K]) against transposed ([K, N]), at M of
      # BLAS_ROWS (default 64: decode)
      timeout 400 python3 bench/bench_blas.py --layouts --rows ${BLAS_ROWS:-64} --json "$OUT/blas_layouts.json" 2>&1 \
        | tee "$OUT/blas_layouts.log" | grep -E "^(==|a step|[a-z_]+ +floor)" | cut -c1-100 ;;
    cold)  # LLM(...) to its first token by phase, cold and warm Triton cache
      timeout 400 python3 bench/bench_cold_start.py --json "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log" | tail -6 ;;
    gemm)
      timeout 120 python3 bench/bench_gemm.py --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" | tail -50 ;;
    kernels)
      timeout 90 python3 bench/bench_kernels.py --decode-step-ms 2.079 --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" | tail -14 ;;
    decode)
      timeout 200 python3 bench/bench_decode.py --batch 64 --context 2048 --steps 48 --profile \
        --plot "$OUT/decode.png" 2>&1 \
        | tee "$OUT/decode.log" ;;
    decode_small)  # issue 17: batch 1 and 8 at 4k context, split-KV decode attention on and off
      for b in 1 8; do
        each_config "${SMALL_CONFIGS:-graphs + async,graphs + async + no split-KV}" 200 --batch $b --context 4096 \
          --steps 48 2>&1 | tee "$OUT/decode_b$b.log" | grep -E "^decode|GPU per step"
      done ;;
    logprobs)  # issue 16: what logprobs (sampled + top 5) add to a batch-64 decode step
      each_config "graphs + async,graphs + async + logprobs 5" 200 --batch 64 --context 2048 --steps 48 2>&1 \
        | tee "$OUT/decode_logprobs.log" | grep decode ;;
    prefix)
      timeout 300 python3 bench/bench_prefix.py --plot "$OUT/prefix.png" --json "$OUT/prefix.json" 2>&1 \
        | tee "$OUT/prefix.log" | tail -16 ;;
    hf)  # Hugging Face families at real shapes (random weights): exactness, weight loading, decode, prefix
      for shape in ${HF_SHAPES:-gemma3-4b qwen3-8b}; do
        timeout 420 python3 bench/bench_hf_models.py --shape "$shape" --root /tmp/hf_ckpt \
          --json "$OUT/hf_$shape.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/hf_$shape.log" | tail -6
        timeout 300 python3 bench/bench_decode.py --model "/tmp/hf_ckpt/$shape" --batch 64 --context 4096 \
          --steps 32 --configs "graphs + async" --plot "$OUT/decode_$shape.png" 2>&1 | tee "$OUT/decode_$shape.log" | tail -4
      done
      if [ "${HF_PREFIX:-1}" = 1 ] && [ -d /tmp/hf_ckpt/gemma3-4b ]; then
        timeout 400 python3 bench/bench_prefix.py --model /tmp/hf_ckpt/gemma3-4b --requests 16 --prefix 8192 \
          --pool-gib 40 --plot "$OUT/prefix_gemma3-4b.png" --json "$OUT/prefix_gemma3-4b.json" 2>&1 \
          | tee "$OUT/prefix_gemma3-4b.log" | tail -16
      fi ;;
    serve_profile)  # the served path's CPU per process and per thread, 256 then 64 streams (direct HTTP)
      for c in ${SERVE_LEVELS:-256 64}; do
        timeout 200 python3 bench/profile_serve.py --direct-http --model bench --device cuda --max-num-seqs 256 \
          --clients $c --client-procs 4 --max-tokens 64 --prompt-mix 128,512,2048 --shared-prefixes 4 \
          --duration ${SERVE_DUR:-20} --json "$OUT/serve_profile_$c.json" 2>&1 \
          | tee "$OUT/serve_profile_$c.log" | grep -A 30 "clients ("
      done ;;
    serve_replicas)  # 256 streams through 1 and 2 ingress replicas, alternating (1 2 1 2), direct HTTP
      for r in ${REPLICA_ORDER:-1 2 1 2}; do
        timeout 150 python3 bench/profile_serve.py --direct-http --model bench --device cuda --max-num-seqs 256 \
          --num-replicas $r --clients ${SERVE_CLIENTS:-256} --client-procs 4 --max-tokens 64 \
          --prompt-mix 128,512,2048 --shared-prefixes 4 --duration ${SERVE_DUR:-20} 2>&1 \
          | tee -a "$OUT/serve_replicas.log" | grep -A 30 "clients ("
      done ;;
    pdl_tests)  # the kernels launched as programmatic dependents and the greedy kernel, compiled; graphs, replay, model
      timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rfE --durations=5 -p no:cacheprovider -p no:benchmark -n 16 \
        --timeout ${TEST_TIMEOUT:-200} tests/kernels/test_greedy.py tests/kernels/test_fused_layers.py \
        tests/kernels/test_attention_split.py tests/worker tests/model/test_model_gpu.py \
        tests/engine/test_engine_replay.py tests/engine/test_request_isolation.py 2>&1 \
        | tee "$OUT/gpu_tests_pdl.log" | tail -12 ;;
    pdl)  # what programmatic dependent launch saves per graph node
      timeout 120 python3 bench/bench_pdl.py --json "$OUT/pdl.json" 2>&1 | tee "$OUT/pdl.log" | tail -10 ;;
    hf_pdl)  # Gemma-3-4B's decode step (batch 64, 4k): as shipped, without PDL, with the fp32 greedy path
      # (HF_EXACT= , set and empty, also checks greedy tokens against transformers first)
      timeout 300 python3 bench/bench_hf_models.py --shape gemma3-4b --root /tmp/hf_ckpt ${HF_EXACT---skip-exactness} \
        --json "$OUT/hf_gemma3-4b.json" 2>&1 | grep -v "Loading weights" | tail -3
      each_config "${HF_CONFIGS:-graphs + async,graphs + async + no PDL,graphs + async + fp32 greedy}" 200 \
        --model /tmp/hf_ckpt/gemma3-4b --batch 64 --context 4096 --steps 32 ${HF_PROFILE:-} 2>&1 \
        | tee "$OUT/decode_gemma3-4b_pdl.log" | grep -v "^    " ;;
    hf_blas)  # Gemma-3-4B's decode step (batch 64, 4k) with the projections on cuBLAS and on cuBLASLt
      timeout 300 python3 bench/bench_hf_models.py --shape gemma3-4b --root /tmp/hf_ckpt --skip-exactness 2>&1 \
        | grep -v "Loading weights" | tail -3
      timeout 300 python3 bench/bench_decode.py --model /tmp/hf_ckpt/gemma3-4b --batch 64 --context 4096 \
        --steps 32 --configs "graphs + async,graphs + async + cuBLASLt" 2>&1 | tee "$OUT/decode_gemma3-4b_blas.log" \
        | grep decode ;;
    throughput)
      timeout 200 python3 bench/bench_throughput.py --plot "$OUT/throughput.png" --json "$OUT/throughput.json" 2>&1 \
        | tee "$OUT/throughput.log" | tail -25 ;;
  esac
done
