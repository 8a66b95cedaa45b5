#!/usr/bin/env bash
# The served path on the GPU machine, in one call (issue items 1 and 3): from the repo root, .whl/ carried,
# built with EXTRA="httptools uvloop" SERVE=1 ../shared/device/make-wheels.sh (a pip install of ray[serve] brings both;
# without httptools uvicorn falls back to its pure-Python h11 parser, as in the 2026-12-03 run),
#   bash bench/bench_serve_gpu.sh          # logs and JSON into $OUT (or ./out); about 6-8 minutes
# 1. `raystate serve --model bench --device cuda` in the background: launch -> first 200 from /health timed
#    (serve_cold_start.json), its log kept with the worker's start-up phases (serve_server.log).
# 2. bench_serve.py against it (--no-baseline): one client, TTFT of 128-byte prompts x 64 tokens; then 64
#    and 256 streams of the mixed workload (prompt lengths from $MIX, 4 shared prefixes), $DUR s each.
# 3. The server stopped (SIGINT: its drain, then its Ray), then bench_serve.py --baseline-from: the same
#    work through the engine in this process (engine streams, LLM.generate, in-process TTFT); the table
#    with the ratios is in serve_gpu.log, every figure in serve_gpu.json.
# MODES: the server runs once per mode, "direct-http" (the replica answers HTTP itself, raystate serve's
# default) and "no-direct-http" (through Serve's proxy); the baselines compare the first mode's figures.
# Knobs (environment): WARMUP_S (8: unmeasured load before the levels; 0: none), REPLICAS (ingress replicas; unset: raystate serve's default, 2 on a GPU host), DUR (15), LEVELS ("64 256"), MIX (128,512,2048), SEQS (the server's max_num_seqs,
# 256), PROCS (client processes, 4), PORT (8011), TTFT_N (30), GEN_AT_CONC (1: LLM.generate of the
# 64 level on an engine capped at 64, one more engine start; 0: skip it), CEILING (1: last, the Serve
# path over a stand-in engine, bench/profile_serve.py --fake-step-ms; 0: skip it). A CPU dry run:
#   GPU_SETUP=0 PY=.venv/bin/python MODEL=tiny DEVICE=cpu MIX=64,256,1024 LEVELS="4 16" SEQS=16 DUR=5 \
#     PROCS=2 OUT=/tmp/serve_cpu bash bench/bench_serve_gpu.sh
set -o pipefail
if [ "${GPU_SETUP:-1}" = 1 ]; then . bench/gpu_setup.sh || exit 1; fi
PY=${PY:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
PORT=${PORT:-8011}
DUR=${DUR:-15}
LEVELS=${LEVELS:-64 256}
MIX=${MIX:-128,512,2048}
SEQS=${SEQS:-256}
PROCS=${PROCS:-4}
TTFT_N=${TTFT_N:-30}
GEN_AT_CONC=${GEN_AT_CONC:-1}
MODES=${MODES:-direct-http no-direct-http}  # raystate serve --direct-http (default), then through Serve's proxy
ENGINE=(--model "${MODEL:-bench}" --device "${DEVICE:-cuda}" --max-num-seqs "$SEQS")
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

for mode in $MODES; do
echo "== serve ($mode): start"
launch=$(date +%s.%N)
"$PY" -m raystate serve "${ENGINE[@]}" --port "$PORT" --verbose --shutdown-grace-s 5 "--$mode" \
  ${REPLICAS:+--num-replicas "$REPLICAS"} \
  >"$OUT/serve_server_$mode.log" 2>&1 &
server=$!
LAUNCH=$launch PORT=$PORT SERVER_PID=$server timeout 400 "$PY" - <<'PY' | tee "$OUT/serve_cold_start_$mode.json"
import json, os, time, urllib.request
launch, url, pid = float(os.environ["LAUNCH"]), f"http://127.0.0.1:{os.environ['PORT']}", int(os.environ["SERVER_PID"])
first_answer = None
while True:
    try:
        os.kill(pid, 0)
    except OSError:
        print(json.dumps({"healthy_s": None, "error": "the server exited"})); break
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=70) as r:
            first_answer = first_answer or time.time() - launch
            if r.status == 200:
                print(json.dumps({"healthy_s": round(time.time() - launch, 2),
                                  "first_http_answer_s": round(first_answer, 2)}))
                break
    except OSError as e:
        if getattr(e, "code", None) is not None:  # an HTTP error: the proxy answers, the app not yet
            first_answer = first_answer or time.time() - launch
    time.sleep(0.25)
PY
# The worker's start-up phases, read from the worker actor itself (WorkerActor.startup_phases), and the
# server log's milestones as seconds after the launch.
LAUNCH=$launch LOG="$OUT/serve_server_$mode.log" timeout 60 "$PY" - <<'PY' 2>/dev/null | tee "$OUT/serve_start_phases_$mode.json"
import datetime, json, os, re, ray
launch, out = float(os.environ["LAUNCH"]), {"worker_phases_s": {}, "log_milestones_s": {}}
marks = {"ray started": "Started a local Ray instance", "serve started": "Started Serve in namespace",
         "replica added": "Adding 1 replica", "app ready": "is ready at"}
for line in open(os.environ["LOG"], errors="replace"):
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
    for name, text in marks.items():
        if m and text in line and name not in out["log_milestones_s"]:
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out["log_milestones_s"][name] = round(t - launch, 2)
ray.init(address="auto", namespace="raystate", log_to_driver=False, logging_level="ERROR")
for i in range(8):
    try:
        w = ray.get_actor(f"worker-{i}", namespace="raystate")
    except ValueError:
        break
    phases = ray.get(w.startup_phases.remote(), timeout=30)
    out["worker_phases_s"][f"worker-{i}"] = {k: round(v, 2) for k, v in phases.items()}
print(json.dumps(out))
PY
grep -h "raystate:\|Started a local Ray\|Adding 1 replica\|is ready at" "$OUT/serve_server_$mode.log" | cut -c1-160 | head -8

if [ "${WARMUP_S:-8}" != 0 ]; then
  # Unmeasured load first, at the largest level: a fresh machine's Triton cache is empty, and kernels the
  # start-up did not compile (prefill tiles of long prompts, say) would otherwise compile inside the first
  # measured window; the baselines, run later in this call, find them compiled.
  echo "== serve ($mode): warm-up, ${WARMUP_S:-8} s (not measured)"
  timeout 120 "$PY" bench/bench_serve.py --url "http://127.0.0.1:$PORT" --no-baseline "${ENGINE[@]}" \
    --clients "${LEVELS##* }" --duration "${WARMUP_S:-8}" --max-tokens 64 --prompt-mix "$MIX" --shared-prefixes 4 \
    --ttft-requests 0 --client-procs "$PROCS" --seed 1 --plot "" --json "$OUT/serve_warmup_$mode.json" 2>&1 \
    | grep -i "output tokens/s\|error" | tail -3
fi
echo "== serve ($mode): load"
# shellcheck disable=SC2086
timeout 330 "$PY" bench/bench_serve.py --url "http://127.0.0.1:$PORT" --no-baseline "${ENGINE[@]}" \
  --clients $LEVELS --duration "$DUR" --max-tokens 64 --prompt-mix "$MIX" --shared-prefixes 4 \
  --ttft-requests "$TTFT_N" --ttft-prompt-len 128 --ttft-max-tokens 64 --client-procs "$PROCS" \
  --json "$OUT/serve_served_$mode.json" --plot "$OUT/serve_served_$mode.png" 2>&1 | grep -v "^load" | tee "$OUT/serve_load_$mode.log" | tail -45
"$PY" -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/status').read().decode())" >"$OUT/serve_status_$mode.json" 2>&1

echo "== serve ($mode): stop"
kill -INT "$server"
for _ in $(seq 1 60); do kill -0 "$server" 2>/dev/null || break; sleep 0.5; done
kill -0 "$server" 2>/dev/null && { echo "server still up: SIGKILL"; kill -KILL "$server"; }
sleep 2
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used --format=csv,noheader

done

echo "== serve: baselines"
gen=--generate-at-concurrency
[ "$GEN_AT_CONC" = 1 ] || gen=--no-generate-at-concurrency
timeout 330 "$PY" bench/bench_serve.py --baseline-from "$OUT/serve_served_${MODES%% *}.json" $gen \
  --json "$OUT/serve_gpu.json" --plot "$OUT/serve_gpu.png" 2>&1 | tee "$OUT/serve_gpu.log" | tail -60

if [ "${CEILING:-1}" = 1 ]; then
  # The Serve path's own ceiling on this host: the same app over a stand-in engine that steps every 25 ms
  # (about the bench model's batch-256 decode step), 256 streams: no GPU, no scheduler, no worker.
  echo "== serve: Serve path ceiling (stand-in engine)"
  timeout 120 "$PY" bench/profile_serve.py --clients "${CEIL_CLIENTS:-256}" --duration 15 --fake-step-ms "${CEIL_STEP_MS:-25}" --max-tokens 64 \
    --client-procs "$PROCS" --json "$OUT/serve_ceiling.json" 2>&1 | grep -v "^load" | tee "$OUT/serve_ceiling.log" | tail -12
fi
