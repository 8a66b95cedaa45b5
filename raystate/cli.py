"""The `raystate` command line (`python -m raystate` is the same).

raystate serve [--host 127.0.0.1] [--port 8000] [--model tiny|FOLDER|HUB_ID] [--num-shards 1] [--api-key KEY]
               [--allowed-host HOST] [--cors-origin ORIGIN] [--header-timeout-s 5] [--body-timeout-s 10]
               [--shutdown-grace-s 30] [--backend ray|inprocess] [engine flags: --device cuda
               --max-num-seqs 64 --block-size 16 ... (every EngineArgs field; serve --help lists them)]
raystate generate [--prompt TEXT ...]
raystate status [--url http://127.0.0.1:8000]
raystate bench [--suite serve] [script options]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from raystate.engine_args import BACKENDS, EngineArgs, build_engine_config, knobs
from raystate.serve.reasoning import REASONING_PARSERS
from raystate.serve.tool_calls import TOOL_CALL_PARSERS

DEFAULT_PROMPTS = [
    "The sliding window keeps",
    "Engram memory hashes n-grams so that",
    "Prefix caching with bounded replay",
]


def _generate(args: argparse.Namespace) -> int:
    from raystate import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(_engine_args(args)), backend=args.backend)
    # Unset flags: the model's defaults (a checkpoint's generation_config.json; else greedy).
    defaults = llm.get_default_sampling_params()
    temperature = defaults.temperature if args.temperature is None else args.temperature
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=temperature,
        top_p=defaults.top_p if args.top_p is None else args.top_p,
        top_k=defaults.top_k if args.top_k is None else args.top_k,
        seed=args.seed if temperature > 0 else None,
        regex=args.regex,
        choice=args.choice,
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, sampling_params=params)
    finally:
        llm.shutdown()
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    for o in outs:
        print(f"--- prompt: {o.prompt!r}")
        print(f"    output: {o.text!r}")
        print(f"    tokens: {len(o.token_ids)}  finish: {o.finish_reason}  cached: {o.num_cached_tokens}")
    print(
        f"[raystate] model={args.model} ({describe_model(llm.config.model)}) device={args.device}: "
        f"{len(outs)} prompts, {n} tokens in {dt:.2f} s"
    )
    print(f"[raystate] {llm.config.kv_summary()}")
    return 0


def describe_model(model) -> str:
    """A model's family and length limit, for what the CLI prints: "qwen3, max_model_len 40960"."""
    arch = model.architecture
    family = "raystate reference hybrid" if arch == "raystate_hybrid" else f"Hugging Face {arch}"
    return f"{family}, max_model_len {model.max_model_len}"


def _curl_example(url: str, model: str, api_key: str | None) -> str:
    auth = " -H 'Authorization: Bearer $RAYSTATE_API_KEY'" if api_key else ""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 16, "temperature": 0})
    return f"curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


class _StopSignals:
    """SIGINT and SIGTERM, counted instead of raised: the first starts the drain, a second cuts the
    grace period short, a third stops without waiting.

    The handler only appends to a list and `wait` polls it. A handler must take no lock: it runs in the
    main thread between two bytecodes, also while that thread holds a lock of its own (setting a
    threading.Event from it deadlocked when the signal came while the waiting thread held the Event's
    lock)."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict = {}

    def __enter__(self) -> _StopSignals:
        self._previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _handler(self, signum, _frame) -> None:
        self.received.append(signum)

    def wait(self, count: int, timeout_s: float | None = None) -> bool:
        """Blocks until `count` signals came (True) or `timeout_s` passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self.received) < count:
            left = self.POLL_S if deadline is None else min(self.POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            time.sleep(left)
        return True


def _start_drain_notice(app_name: str):
    """The DrainNotice actor the replicas of `app_name` look up when they start (None if its name is
    taken: another `raystate serve` of that name on this cluster; the drain is then Serve's own)."""
    import ray

    from raystate.serve.app import DRAIN_NAMESPACE, DrainNotice, drain_notice_name

    try:
        return (
            ray.remote(DrainNotice)
            .options(name=drain_notice_name(app_name), namespace=DRAIN_NAMESPACE, num_cpus=0)
            .remote()
        )
    except ValueError as e:
        print(f"raystate: warning: no drain on shutdown: {e}", file=sys.stderr)
        return None


def _drain(notice, grace_s: float, num_replicas: int, signals: _StopSignals) -> None:
    """Tells every replica to drain (503 for new requests; running ones get `grace_s`, then streams end
    with an error event and [DONE]) and waits for their reports; a second signal cuts the grace short,
    a third stops waiting."""
    import ray

    from raystate.serve.server import DRAIN_CUT_MARGIN_S

    ray.get(notice.drain.remote(grace_s), timeout=30)
    # The replicas' own bound is grace + margin; a little more for their reports to arrive.
    deadline = time.monotonic() + grace_s + DRAIN_CUT_MARGIN_S + 5.0
    seen = len(signals.received)
    while time.monotonic() < deadline:
        if ray.get(notice.num_drained.remote(), timeout=30) >= num_replicas:
            print("raystate: drained", flush=True)
            return
        signals.wait(seen + 1, timeout_s=0.2)
        if len(signals.received) > seen:
            seen = len(signals.received)
            if seen >= 3:
                print("raystate: third signal: not waiting for the drain", flush=True)
                return
            print("raystate: second signal: ending every request now", flush=True)
            ray.get(notice.drain.remote(0.0), timeout=30)
            deadline = min(deadline, time.monotonic() + DRAIN_CUT_MARGIN_S + 5.0)
    print("raystate: drain timed out; stopping anyway", flush=True)


def _local_ray_exited(wait_s: float) -> list[str]:
    """The kinds of the local Ray's processes that have exited ("log_monitor", "raylet", ...), polled for
    up to `wait_s` until one has. A SIGTERM sent to the whole process group (GNU `timeout`, a shell's
    `kill -- -PGID`; systemd's KillMode=control-group does the same to the cgroup) reaches Ray's daemons,
    workers and replicas as well: then nothing is left to drain, and every call into that Ray would only
    wait out its timeout (30 s each, then a minute of the core worker retrying its GCS). Ray keeps its
    processes' Popen handles on the node object; a private API, hence [] wherever it differs."""
    import ray

    deadline = time.monotonic() + wait_s
    try:
        node = ray._private.worker._global_node
        while True:
            exited = sorted({kind for kind, _ in node.dead_processes()})
            if exited or time.monotonic() >= deadline:
                return exited
            time.sleep(0.02)
    except Exception:
        return []


def _header_timeout_env(header_timeout_s: float) -> dict[str, str]:
    """The environment that makes Serve's proxy bound request head reads (proxy_guard.py)."""
    from raystate.serve import proxy_guard

    if header_timeout_s <= 0:
        return {}
    current = os.environ.get(proxy_guard.CALLBACK_ENV)
    if current and current != proxy_guard.CALLBACK:
        print(
            f"raystate: warning: request headers are not time-bounded: {proxy_guard.CALLBACK_ENV} is "
            f"already set ({current})",
            file=sys.stderr,
        )
        return {}
    return {
        proxy_guard.CALLBACK_ENV: proxy_guard.CALLBACK,
        proxy_guard.HEADER_TIMEOUT_ENV: f"{header_timeout_s:g}",
    }


def _json_object(text: str) -> dict:
    """--ray-options' value: a JSON object (its fields are checked with the app's other args)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of launch options, not {type(value).__name__}")
    return value


def _words(values: list[str] | None) -> list[str]:
    """Repeated and comma-separated flag values as one list."""
    return [w.strip() for v in values or [] for w in v.split(",") if w.strip()]


# EngineArgs fields with a CLI spelling of their own: kv_cache_bytes is given in GiB.
_ENGINE_FLAGS_SPELT_OTHERWISE = ("kv_cache_bytes",)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field (`--max-num-seqs`, `--no-enable-prefix-caching`, ...): the knobs
    and defaults of `LLM(...)` and of the Serve app's args, generated so that they cannot drift."""
    group = parser.add_argument_group("engine", "the model and its engine (the knobs of LLM(...))")
    for knob in knobs():
        if knob.name in _ENGINE_FLAGS_SPELT_OTHERWISE:
            continue
        flag = "--" + knob.name.replace("_", "-")
        if knob.value_type is bool:
            shown = f" (default: {'on' if knob.default else 'off'})"
            kind = dict(action=argparse.BooleanOptionalAction)
        else:
            shown = "" if knob.default is None else f" (default: {knob.default})"
            kind = dict(type=knob.value_type)
        group.add_argument(flag, default=knob.default, help=knob.help + shown, **kind)
    group.add_argument(
        "--kv-cache-gib",
        type=float,
        help="KV cache per shard in GiB, split across the attention groups (default: on CUDA, sized "
        "from --gpu-memory-utilization; on the CPU, from max-num-seqs and the model's max length)",
    )


def _engine_args(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs of `_add_engine_flags`' flags."""
    values = {k.name: getattr(args, k.name) for k in knobs() if k.name not in _ENGINE_FLAGS_SPELT_OTHERWISE}
    kv_cache_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30)
    return EngineArgs(**values, kv_cache_bytes=kv_cache_bytes)


# With direct HTTP each ingress replica's event loop writes every token of its streams; one loop spends
# about 40 us of CPU on an event (H200 host), so 64 streams of a 2.6 ms decode step fill it and their
# tokens leave two at a time. Two replicas share the streams: measured on the H200 with the bench model,
# 64 streams' inter-token p50 went from 1.54-1.56x to 1.05-1.09x the engine's own (BENCHMARKS.md, "The
# served path"), with no measurable change in tokens/s at 256 streams. A CPU engine steps too slowly for
# this to matter, and a small host has no core to spare for a second event loop.
AUTO_REPLICAS_GPU = 2
AUTO_REPLICAS_MIN_CPUS = 8


def ingress_replicas(
    requested: int | None, direct_http: bool, device: str, backend: str, cpus: int | None
) -> int:
    """`--num-replicas` when given; else AUTO_REPLICAS_GPU for a CUDA engine on the Ray backend (whose
    replicas share one engine; in-process, each replica would hold an engine of its own) served over
    direct HTTP on a host of at least AUTO_REPLICAS_MIN_CPUS CPUs, and 1 otherwise."""
    if requested is not None:
        return requested
    shared_gpu_engine = backend == "ray" and device.startswith("cuda")
    many_cpus = (cpus or 1) >= AUTO_REPLICAS_MIN_CPUS
    return AUTO_REPLICAS_GPU if direct_http and shared_gpu_engine and many_cpus else 1


def _serve(args: argparse.Namespace) -> int:
    from raystate.serve.app import API_KEY_ENV, AppArgs, build_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    local = args.address is None
    direct = local if args.direct_http is None else args.direct_http
    if local and api_key:
        # The local Ray's processes inherit this environment: the key reaches the replica without being
        # written into the application's stored arguments, and a replica without it refuses to start.
        os.environ[API_KEY_ENV] = api_key
    engine_args = _engine_args(args)
    served = args.served_model_name or args.model  # the id clients send as "model"
    app_args = AppArgs(
        **dataclasses.asdict(engine_args),
        backend=args.backend,
        cluster_name=args.name,
        num_shards=args.num_shards,
        num_replicas=ingress_replicas(
            args.num_replicas, direct, engine_args.device, args.backend, os.cpu_count()
        ),
        api_key=None if local else api_key,
        require_api_key=api_key is not None,
        body_timeout_s=args.body_timeout_s,
        allowed_hosts=_words(args.allowed_host),
        cors_allow_origins=_words(args.cors_origin),
        shutdown_grace_s=args.shutdown_grace_s,
        direct_http_port=args.port if direct else None,
        direct_http_host=args.host,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        trust_request_chat_template=args.trust_request_chat_template,
        ray_options=args.ray_options,
        **({"cors_allow_methods": _words(args.cors_method)} if args.cors_method else {}),
        **({"cors_allow_headers": _words(args.cors_header)} if args.cors_header else {}),
    )
    app = build_app(app_args)  # validates the arguments (and resolves the model) before Ray starts
    if local and direct:
        from raystate.serve.direct_http import port_in_use

        if port_in_use(args.host, args.port):
            print(
                f"raystate: error: the server did not start: port {args.port} on {args.host} is in use "
                "(another server? --port picks another)",
                file=sys.stderr,
            )
            return 1
    engine_config = build_engine_config(engine_args)
    model = engine_config.model
    if local:
        # Like the key: Serve's proxy actor, started by the local Ray, inherits the environment.
        os.environ.update(_header_timeout_env(args.header_timeout_s))
    import ray
    from ray import serve

    # No address: a new local Ray of our own (never one found on the machine), stopped on exit.
    ray_context = ray.init(
        address=args.address or "local",
        log_to_driver=args.verbose,
        **({} if args.address or args.ray_dashboard else {"include_dashboard": False}),
    )
    rc = 0
    ray_exited: list[str] = []
    try:
        notice = _start_drain_notice(args.name)  # before the replicas start: they look it up
        if local and args.backend == "ray":
            # The backend's actors (the slow part: a process importing torch, weights, CUDA graphs) start
            # while Serve starts its controller and replica; the replica connects to them
            # (`launch.wait_started`) instead of starting its own.
            _start_backend_in_background(engine_config, args.name, args.num_shards, app_args.ray_options)
        if direct:  # the replicas listen on the port themselves; Serve's proxy would only compete for it
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=args.name, route_prefix="/", blocking=False)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        print(
            f"raystate: serving model {served!r} ({describe_model(model)}; {args.backend} backend, "
            f"{args.num_shards} shard(s), {app_args.num_replicas} ingress replica(s))"
        )
        if args.backend == "ray":
            engine_config = _deployment_config(args.name, engine_config)
        print(f"raystate: {engine_config.kv_summary()}")
        if args.backend == "ray":
            _print_startup_phases(args.name)
        print(f"raystate: OpenAI API at {url}/v1  (health: {url}/health, metrics: {url}/metrics)")
        if getattr(ray_context, "dashboard_url", None):
            print(f"raystate: Ray dashboard at http://{ray_context.dashboard_url}")
        if args.host in ("0.0.0.0", "::"):
            print("raystate: listening on every interface" + ("" if api_key else " WITHOUT an API key"))
        if not local and not direct:
            print("raystate: note: the request header timeout is a setting of the cluster's proxies (README)")
        if direct and not local:
            print("raystate: note: direct HTTP: each node running a replica listens on the port (README)")
        print(f"raystate: try  {_curl_example(url, served, api_key)}")
        with _StopSignals() as signals:
            print("raystate: Ctrl-C stops the server", flush=True)
            signals.wait(1)
            first = signal.Signals(signals.received[0])
            print(f"raystate: {first.name}: shutting down", flush=True)
            # Ray's daemons block SIGINT, so only a SIGTERM can have reached them along with us.
            if local and first == signal.SIGTERM:
                ray_exited = _local_ray_exited(wait_s=0.5)
            if ray_exited:
                print(
                    f"raystate: the local Ray's {', '.join(ray_exited)} exited on the same signal (it was "
                    "sent to the whole process group): no drain; to drain, signal this process only (README)",
                    flush=True,
                )
            elif notice is not None:
                grace = args.shutdown_grace_s
                print(
                    f"raystate: draining: new requests get 503, running ones have {grace:g} s to finish "
                    "(Ctrl-C again: end them now)",
                    flush=True,
                )
                try:
                    _drain(notice, grace, app_args.num_replicas, signals)
                except Exception as e:  # e.g. the notice actor died: stop all the same
                    print(f"raystate: warning: the drain failed ({type(e).__name__}: {e})", file=sys.stderr)
    except KeyboardInterrupt:  # Ctrl-C while starting
        print("raystate: interrupted: shutting down", flush=True)
        rc = 130
    except Exception as e:  # e.g. the port is taken: say why in one line, then clean up
        reason = _reason(e)
        print(f"raystate: error: the server did not start: {reason}", file=sys.stderr)
        rc = 1
    finally:
        try:
            if not ray_exited:  # else Serve's controller and replicas are gone with it
                serve.delete(args.name)
                if local:
                    serve.shutdown()
        finally:
            if local:
                ray.shutdown()
    print("raystate: stopped")
    return rc


def _reason(e: BaseException) -> str:
    """An error in one line: the last line of its message (a Ray error ends with its cause's, e.g. a
    worker's ValueError that names a bad setting), else its type."""
    text = str(e).strip()
    return text.splitlines()[-1] if text else type(e).__name__


_BACKENDS: list = []  # the deployments `_start_backend_in_background` started


def _start_backend_in_background(config, name: str, num_shards: int, ray_options: dict) -> None:
    """Starts the Ray backend's deployment from a thread; its errors are the replica's to report (the
    replica then starts the deployment itself and fails the same way, which `serve.run` shows)."""
    from raystate.cluster import Cluster

    def start() -> None:
        try:  # kept referenced: its actors live as long as this process (a local Ray's driver)
            _BACKENDS.append(Cluster.start(config, name=name, num_shards=num_shards, **ray_options))
        except Exception as e:
            print(f"raystate: the backend did not start here ({_reason(e)}); the replica retries")

    threading.Thread(target=start, name="raystate-backend-start", daemon=True).start()


def _deployment_config(name: str, fallback):
    """The running deployment's config (its KV blocks fixed at start); `fallback` when unreachable."""
    import ray

    from raystate.launch import SCHEDULER_NAME

    try:
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=name)
        return ray.get(scheduler.get_config.remote(), timeout=30)
    except Exception:  # informational only
        return fallback


def _print_startup_phases(name: str) -> None:
    """One line per shard: the seconds of each of its worker's start-up phases (the worker logs them as
    they end, but a Ray worker's log reaches this terminal only with --verbose)."""
    import ray

    from raystate.launch import SCHEDULER_NAME

    try:
        scheduler = ray.get_actor(SCHEDULER_NAME, namespace=name)
        workers = ray.get(scheduler.workers.remote(), timeout=30)
        for shard, worker in sorted(workers.items()):
            phases = ray.get(worker.startup_phases.remote(), timeout=30)
            shown = ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
            print(f"raystate: shard {shard} start-up: {shown}")
    except Exception as e:  # informational only: never stop the server for it
        print(f"raystate: start-up phases unavailable ({type(e).__name__})")


def _get_json(url: str, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url, headers=headers, timeout=30.0)
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def format_status(status: dict) -> str:
    """Shards, requests and KV cache use as a small table."""
    running, waiting = status.get("num_running", []), status.get("num_waiting", [])
    free = status.get("num_free_blocks", [])
    total = status.get("num_blocks")  # usable blocks per group and shard
    dispatch = status.get("dispatch")
    if dispatch and status.get("pipelined"):
        dispatch += ", pipelined"
    lines = [
        f"backend: {status.get('backend', '?')}   shards: {status.get('num_shards', len(running))}"
        + (f"   dispatch: {dispatch}" if dispatch else ""),
        f"{'shard':>5}  {'running':>7}  {'waiting':>7}  KV cache per group (free/total, use)",
    ]
    for shard, (r, w) in enumerate(zip(running, waiting, strict=False)):
        groups = free[shard] if shard < len(free) else []
        if total:
            cache = ", ".join(f"{n}/{total} ({100 * (total - n) / total:.0f}%)" for n in groups)
        else:
            cache = ", ".join(str(n) for n in groups)
        lines.append(f"{shard:>5}  {r:>7}  {w:>7}  {cache}")
    lines.append(
        f"prefix-hit tokens: {status.get('prefix_hit_tokens', 0)}   "
        f"replayed tokens: {status.get('replayed_tokens', 0)}   "
        f"preemptions: {status.get('num_preemptions', 0)}"
    )
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("RAYSTATE_API_KEY") or None
    try:
        status = _get_json(args.url.rstrip("/") + "/status", api_key)
    except Exception as e:  # connection refused, 401, timeout: say so, no traceback
        print(f"raystate: cannot read status from {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _bench(args: argparse.Namespace, rest: list[str]) -> int:
    import runpy

    script = Path(__file__).resolve().parents[1] / "bench" / f"bench_{args.suite}.py"
    if not script.is_file():
        print(f"raystate: {script} not found (raystate bench runs from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *rest]
    sys.path.insert(0, str(script.parent))  # as `python bench/bench_x.py` would: scripts import each other
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="raystate", description="Serve hybrid-attention LLMs with Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI API over Ray Serve (foreground; Ctrl-C stops)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--direct-http",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the ingress replica answers HTTP itself on --host/--port, without Serve's proxy "
        "(raystate/serve/direct_http.py; default: on with a local Ray, off with --address)",
    )
    s.add_argument("--num-shards", type=int, default=1, help="worker actors (one per GPU)")
    s.add_argument(
        "--num-replicas",
        type=int,
        default=None,
        help="ingress replicas (HTTP and streaming; with direct HTTP they share the port), one backend "
        f"(default: {AUTO_REPLICAS_GPU} for a CUDA device on the Ray backend over direct HTTP on a host of "
        f"{AUTO_REPLICAS_MIN_CPUS}+ CPUs, else 1)",
    )
    s.add_argument(
        "--api-key", help="require this bearer key on every route but /health (default: $RAYSTATE_API_KEY)"
    )
    s.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "none", *TOOL_CALL_PARSERS],
        help="how the model writes tool calls, for tool_choice auto (default: auto, the format its chat "
        "template writes if known; hermes: <tool_call> blocks, as Qwen2.5, Qwen3 and Hermes write them; "
        "llama3_json: Llama 3.1's bare JSON calls; none: tool_choice auto refused)",
    )
    s.add_argument(
        "--reasoning-parser",
        default="none",
        choices=["none", *REASONING_PARSERS],
        help="send a reasoning model's <think> text as reasoning_content (qwen3, deepseek_r1; default: "
        "none, the text stays in the content)",
    )
    s.add_argument("--address", help="a running Ray cluster (default: start a local one, stopped on exit)")
    s.add_argument(
        "--ray-dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start Ray's dashboard with the local Ray (--no-ray-dashboard: about 2 s less to start; "
        "ignored with --address)",
    )
    s.add_argument(
        "--backend",
        choices=BACKENDS,
        default="ray",
        help="ray (worker actors) or inprocess (the engine inside the Serve replica)",
    )
    s.add_argument(
        "--ray-options",
        type=_json_object,
        default={},
        metavar="JSON",
        help="the Ray backend's launch options, a JSON object of raystate.launch.LaunchOptions fields, e.g. "
        '\'{"pipeline_steps": true, "placement_strategy": "SPREAD", "step_timeout_s": 60}\' (as the Serve '
        "config's ray_options; --name and --num-shards set the name and shard count)",
    )
    _add_engine_flags(s)
    s.add_argument(
        "--allowed-host",
        action="append",
        metavar="HOST",
        help="accept only requests whose Host header names HOST (a name, *.domain, or *; repeatable or "
        "comma-separated; others get 400). Default: any Host",
    )
    s.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="let web pages of ORIGIN (e.g. https://app.example.com, or *) call the API from a browser "
        "(repeatable or comma-separated). Default: none, no CORS headers",
    )
    s.add_argument(
        "--cors-method", action="append", metavar="METHOD", help="CORS allowed methods (default: GET, POST)"
    )
    s.add_argument(
        "--cors-header",
        action="append",
        metavar="HEADER",
        help="CORS allowed request headers (default: Authorization, Content-Type)",
    )
    s.add_argument(
        "--header-timeout-s",
        type=float,
        default=5.0,
        help="close a connection whose request line and headers are not all in after this long "
        "(slow clients; set in Serve's proxy of the local Ray; 0: no limit). Default: 5",
    )
    s.add_argument(
        "--body-timeout-s",
        type=float,
        default=10.0,
        help="answer 408 when a request body is not all in after this long (slow clients). Default: 10",
    )
    s.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGINT/SIGTERM, new requests get 503 and running ones (streams too) get this long to "
        "finish; streams still open then end with an error event and [DONE]. Default: 30",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEXT",
        help="a Jinja chat template (a file, or the template text) rendered for /v1/chat/completions in "
        "place of the checkpoint's: for a checkpoint that has none, or to fix one (default: the "
        "checkpoint's)",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own chat_template in place of the server's (default: such a "
        "request is refused, since a template is code that runs in the server)",
    )
    s.add_argument(
        "--served-model-name",
        metavar="NAME",
        help='the id clients send as "model" and responses and /v1/models carry (default: --model as '
        "given, e.g. the checkpoint's folder path)",
    )
    s.add_argument("--name", default="raystate", help="the Serve application and backend cluster name")
    s.add_argument("--verbose", action="store_true", help="forward Ray's worker logs to this terminal")
    s.set_defaults(func=_serve)

    g = sub.add_parser("generate", help="generate text for one-off prompts and print it")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three samples")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, help="default: the model's (greedy for tiny and bench)")
    g.add_argument("--top-p", type=float, help="default: the model's (1: off)")
    g.add_argument("--top-k", type=int, help="default: the model's (0: off)")
    g.add_argument("--regex", help="hold each output to this regular expression (structured output)")
    g.add_argument("--choice", action="append", help="each output is one of these strings (repeatable)")
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="inprocess",
        help="inprocess (default: no Ray start-up for a one-off run) or ray (a local Ray deployment)",
    )
    _add_engine_flags(g)  # --model, --device, --seed (also the sampling seed), --revision, --tokenizer, ...
    g.set_defaults(func=_generate)

    st = sub.add_parser("status", help="shards, requests and cache use of a running server")
    st.add_argument("--url", default="http://127.0.0.1:8000")
    st.add_argument("--api-key", help="bearer key (default: $RAYSTATE_API_KEY)")
    st.add_argument("--json", action="store_true", help="print the raw status object")
    st.set_defaults(func=_status)

    b = sub.add_parser(
        "bench", help="run a benchmark script of bench/ (unknown options go to the script)", add_help=False
    )
    b.add_argument(
        "--suite",
        default="serve",
        help="bench/bench_<suite>.py: serve, faults, scheduler, dispatch (CPU or GPU); decode, prefix, "
        "throughput, attention, gemm, kernels, sampling_guard (GPU)",
    )
    b.set_defaults(func=_bench)
    return p


def _reason_lines(error: ValueError) -> str:
    """A pydantic ValidationError (the Serve app's args) as its messages alone, one per line, without
    pydantic's input echo and documentation links; any other error as it reads."""
    details = getattr(error, "errors", None)
    if not callable(details):
        return str(error)
    lines = []
    for d in details():
        where = ".".join(map(str, d.get("loc", ())))
        message = str(d.get("msg", "")).removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where and not message.startswith(f"{where}") else message)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    if args.cmd != "bench" and rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest) if args.cmd == "bench" else args.func(args)
    except ValueError as e:
        print(f"raystate: error: {_reason_lines(e)}", file=sys.stderr)
        return 2
