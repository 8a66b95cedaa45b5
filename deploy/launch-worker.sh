#!/usr/bin/env bash
# Joins a bare GPU machine to a raystate cluster started by launch-head.sh.
#
#   RAY_AUTH_TOKEN=<head's token> RAYSTATE_API_KEY=... deploy/launch-worker.sh --head HOST:PORT
#                                                       [--num-gpus N] [--dry-run]
#
# The head's token (its ~/.ray/auth_token) must be in RAY_AUTH_TOKEN or this machine's token file:
# token authentication stays on. Export the same RAYSTATE_API_KEY as on the head (the ingress replica
# may run here). --dry-run prints the commands instead of running them.
set -euo pipefail

head_address=""
num_gpus=""
dry_run=0

usage() { sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --head) head_address="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "launch-worker.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

if [[ -z "$head_address" ]]; then
  echo "launch-worker.sh: --head HOST:PORT is required" >&2
  usage >&2
  exit 2
fi

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
  echo "launch-worker.sh: no Ray token: set RAY_AUTH_TOKEN to the head's ~/.ray/auth_token" >&2
  [[ $dry_run -eq 1 ]] || exit 1
fi

start=(ray start --address "$head_address")
if [[ -n "$num_gpus" ]]; then
  start+=(--num-gpus "$num_gpus")
fi
run "${start[@]}"
