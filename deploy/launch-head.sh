#!/usr/bin/env bash
# Starts the Ray head of a raystate cluster on a bare machine and deploys the Serve app on it.
#
#   RAYSTATE_API_KEY=... deploy/launch-head.sh [--port 6379] [--num-gpus N] [--serve-config FILE]
#                                               [--no-serve] [--dry-run]
#
# Token authentication stays on: RAY_AUTH_MODE=token, and a token is generated into ~/.ray/auth_token
# unless RAY_AUTH_TOKEN or a token file exists. Copy that token to each worker (launch-worker.sh).
# The dashboard listens on 127.0.0.1 only; reach it through an SSH tunnel. --dry-run prints the commands.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
port=6379
num_gpus=""
serve_config="$here/serve_config.yaml"
deploy_serve=1
dry_run=0

usage() { sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --serve-config) serve_config="$2"; shift 2 ;;
    --no-serve) deploy_serve=0; shift ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "launch-head.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

run() {
  if [[ $dry_run -eq 1 ]]; then
    echo "+ $*"
  else
    "$@"
  fi
}

export RAY_AUTH_MODE=token
token_file="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
if [[ -z "${RAY_AUTH_TOKEN:-}" && ! -s "$token_file" ]]; then
  run ray get-auth-token --generate
fi
if [[ -z "${RAYSTATE_API_KEY:-}" ]]; then
  echo "launch-head.sh: RAYSTATE_API_KEY is not set: the OpenAI API will accept requests without a key" >&2
fi

start=(ray start --head --port "$port" --dashboard-host 127.0.0.1)
if [[ -n "$num_gpus" ]]; then
  start+=(--num-gpus "$num_gpus")
fi
run "${start[@]}"

if [[ $deploy_serve -eq 1 ]]; then
  run serve deploy "$serve_config" --address http://127.0.0.1:8265
fi
echo "launch-head.sh: workers join with: deploy/launch-worker.sh --head $(hostname -I 2>/dev/null | awk '{print $1}'):$port"
