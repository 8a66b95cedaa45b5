#!/usr/bin/env bash
# lm-evaluation-harness against a running `raystate serve`, as its users run it (issue "OpenAI API").
# The commands behind BENCHMARKS.md's "lm-eval against the server" section; the opt-in test
# tests/evals/test_lm_eval_harness.py runs the same and checks the numbers against the offline LLM.
#
#   .venv/bin/pip install "lm-eval[api]==0.4.13"   # not in pyproject.toml: ~550 MB with datasets, pandas, ...
#   evals/run_lm_eval.sh [CHECKPOINT_FOLDER] [PORT] [OUT]
#
# Tasks: evals/tasks/raystate_tiny (20 local items; custom_dataset reads data.jsonl, nothing is downloaded):
# raystate_tiny_ll (multiple_choice, 4 choices: 80 loglikelihood requests) and raystate_tiny_gen
# (generate_until "\n", 16 tokens, exact_match).
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT=${1:-/tmp/raystate_lm_eval/qwen3}
PORT=${2:-8931}
OUT=${3:-/tmp/raystate_lm_eval/out}
PY=.venv/bin/python
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 1. The tiny random Qwen3 checkpoint of tests/hfmodels (byte-level BPE tokenizer, chat template).
[ -f "$CKPT/config.json" ] || $PY evals/make_tiny_checkpoint.py "$CKPT"

# 2. The server (kernels' PyTorch references on the CPU, float32). The served model name is the folder.
#    Add --no-swa-bounded-replay for generations equal to an uncached run (see BENCHMARKS.md).
RAYSTATE_KERNELS=reference .venv/bin/raystate serve --model "$CKPT" --backend inprocess \
    --host 127.0.0.1 --port "$PORT" --device cpu --dtype float32 > "${OUT}.server.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER; wait $SERVER || true' EXIT
# ready once /v1/models answers (/health answers 400 for this checkpoint: it has no BOS token)
until curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null; do sleep 1; done

# 3. /v1/completions: loglikelihood (prompt token ids, echo, logprobs=1, max_tokens=1) and generate_until.
#    tokenizer_backend=huggingface + tokenizer=: lm-eval needs a tokenizer for loglikelihood context
#    lengths (tokenizer_backend=none is refused for loglikelihood). batch_size must stay 1 (the server
#    takes one prompt per request); num_concurrent=N for parallel requests.
time .venv/bin/lm_eval --model local-completions \
    --model_args "model=$CKPT,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$CKPT,max_retries=1" \
    --tasks raystate_tiny_ll,raystate_tiny_gen --include_path evals/tasks \
    --log_samples --output_path "$OUT/completions"

# 4. /v1/chat/completions with the chat template (generate_until only: chat has no loglikelihood).
time .venv/bin/lm_eval --model local-chat-completions \
    --model_args "model=$CKPT,base_url=http://127.0.0.1:$PORT/v1/chat/completions,max_retries=1" \
    --apply_chat_template --tasks raystate_tiny_gen --include_path evals/tasks \
    --log_samples --output_path "$OUT/chat"
