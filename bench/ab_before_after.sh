#!/usr/bin/env bash
# Before/after, side by side on the GPU machine: an older commit's tree and the working tree run the
# same benches alternately in one session (the "Before and after" tables of BENCHMARKS.md).
#   here:                 bash bench/ab_before_after.sh --export REV   # writes REV's tree to .before/
#   on the GPU machine:   ROUNDS="1 2" bash bench/ab_before_after.sh decode attention
#                         (carry [".whl", ".before"]; .before/ must be git-ignored, e.g. in .git/info/exclude)
#   parts: attention decode split small small_kernels gemma (small_kernels needs bench_small_kernels.py in
#   .before/bench too; gemma needs /tmp/hf_ckpt/gemma3-4b: bench_hf_models.py)
# The old tree runs with .before/ first on PYTHONPATH (its raystate.kernels through a link to its own
# kernels/); the working tree is installed editable by gpu_setup.sh. Logs go to $OUT (or ./out).
if [ "$1" = "--export" ]; then
  rm -rf .before && mkdir .before && git archive "${2:?REV}" raystate kernels bench pyproject.toml | tar -x -C .before
  rm -rf .before/bench/results && exit 0
fi
. bench/gpu_setup.sh || exit 1
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
ln -sfn ../kernels .before/raystate/kernels
before_env="env PYTHONPATH=$PWD/.before:$PYTHONPATH"
for part in ${*:-attention decode}; do
  for round in ${ROUNDS:-1}; do
    for side in before after; do
      if [ $side = before ]; then cd .before; run="$before_env"; else run=""; fi
      echo "== $part $side round $round"; SECONDS=0
      case $part in
        attention) timeout 200 $run python3 bench/bench_attention.py 2>&1 | tee "$OUT/attention_${side}_$round.log" | tail -24 ;;
        decode) timeout 150 $run python3 bench/bench_decode.py --batch 64 --context 2048 --steps 48 2>&1 \
          | tee "$OUT/decode_${side}_$round.log" | grep -v "^\[" | tail -12 ;;
        split) timeout 200 $run python3 bench/bench_attention.py --split-only 2>&1 \
          | tee "$OUT/split_${side}_$round.log" | grep -E "^(B=|D=|plain|empty)" | cut -c1-120 ;;
        gemma) timeout 150 $run python3 bench/bench_decode.py --model /tmp/hf_ckpt/gemma3-4b --batch 64 --context 4096 \
          --steps 32 --configs "graphs + async" ${GEMMA_ARGS:-} 2>&1 | tee "$OUT/gemma_${side}_$round.log" \
          | grep -E "^decode|profile of|^ +[0-9.]+ us/step|attention:" ;;
        small_kernels) timeout 120 $run python3 bench/bench_small_kernels.py 2>&1 | tee "$OUT/small_kernels_${side}_$round.log" ;;
        small) for b in 1 8; do timeout 150 $run python3 bench/bench_decode.py --batch $b --context 4096 \
            --steps 48 --configs "graphs + async" 2>&1 | tee "$OUT/small_b${b}_${side}_$round.log" | grep "^decode"; done ;;
      esac
      echo "($SECONDS s)"; [ $side = before ] && cd ..
    done
  done
done
