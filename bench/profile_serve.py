"""Where the served path spends its CPU: bench_serve's load against the Serve app, with the CPU time of each
process over the load (the clients, Serve's proxy, the ingress replica, the scheduler actor, the worker,
Ray's own daemons) and, with --py-spy, sampled stacks of the chosen processes summed by function.

    python bench/profile_serve.py [--clients 16] [--duration 15] [--py-spy proxy,replica,scheduler]

The processes are found by their Ray command lines (ray::ProxyActor, ray::ServeReplica:...,
ray::SchedulerActor, ray::WorkerActor). The clients run in a process of their own
(bench_serve.run_load), so their cost is counted apart. py-spy samples at --rate Hz with --nonblocking
(no pauses of the target); its
leaf frames (self time) and every frame (inclusive time) are reported as a share of the samples.
--micro: our own per-event cost without Ray (RaystateServer's stream, our ASGI app, the poll thread's
hand-over), over a stand-in client that answers at once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time

from bench_serve import Workload, run_load_procs, start_server, stop_server, summarize

ROLES = {
    "proxy": "ray::ProxyActor",
    "replica": "ray::ServeReplica",
    "scheduler": "ray::SchedulerActor",
    "worker": "ray::WorkerActor",
    "controller": "ray::ServeController",
}


def processes() -> dict[int, str]:
    """pid -> role (or a short command name) of this user's processes."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not cmd:
            continue
        role = next((r for r, tag in ROLES.items() if cmd.startswith(tag)), None)
        if role is None:
            base = os.path.basename(cmd.split()[0])
            if any(k in cmd for k in ("raylet", "gcs_server", "dashboard", "log_monitor", "ray::", "ray/")):
                role = "ray:" + (cmd.split()[0].split("::")[-1] if "::" in cmd else base)[:40]
            else:
                continue
        out[int(pid)] = role
    return out


def _stat_cpu(path: str) -> tuple[str, float]:
    """(command name, user + system CPU seconds) from a /proc stat file (a process's or a thread's)."""
    with open(path) as f:
        head, rest = f.read().rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    try:
        return _stat_cpu(f"/proc/{pid}/stat")[1]
    except OSError:
        return 0.0


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid`, keyed "name/tid" (the kernel's thread name, as Ray and
    Python set it)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name, seconds = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # the thread ended meanwhile
            continue
        out[f"{name}/{tid}"] = seconds
    return out


def _client_proc(url, clients, duration, max_tokens, workload, model, procs, conn) -> None:
    records, start, info = run_load_procs(url, None, clients, duration, max_tokens, workload, model, procs)
    conn.send((summarize(records, start, max_tokens), info, time.process_time()))


def fold(path: str, top: int) -> list[str]:
    """py-spy --format raw (collapsed stacks) -> the top functions by self and by inclusive samples."""
    self_n, incl_n, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not stack:
                continue
            n = int(n)
            total += n
            frames = stack.split(";")
            self_n[frames[-1]] += n
            for fr in set(frames):
                incl_n[fr] += n
    lines = [f"    {total} samples"]
    lines.append("    self:")
    lines += [f"      {100 * c / total:5.1f}%  {fr[:150]}" for fr, c in self_n.most_common(top)]
    lines.append("    inclusive:")
    lines += [f"      {100 * c / total:5.1f}%  {fr[:150]}" for fr, c in incl_n.most_common(top * 2)]
    return lines


# -- --fake-step-ms: the Serve app over a stand-in engine stepping at a fixed cadence -----------------------


class PacedFactory:
    """A client factory for `make_app`: a stand-in engine that gives every running request one token per
    `step_ms` (all of them in one tick, as a decode step does), so the served path's own ceiling shows:
    with N clients the ideal is N tokens per step, each gap one step. Pickled by value (defined in the
    script), it runs in the replica."""

    def __init__(self, model: str, step_ms: float) -> None:
        from raystate.serve.app import AppArgs

        self.config = AppArgs(model=model, backend="inprocess").engine_config()
        self.step_s = step_ms / 1e3

    def __call__(self):
        from raystate.client import Client
        from raystate.messages import RequestUpdate

        config, step_s = self.config, self.step_s

        class PacedClient(Client):
            def __init__(self) -> None:
                self.active: dict[str, list] = {}
                self.ticker = None
                self.steps = 0

            config = property(lambda self: config)

            def generate(self, prompt_token_ids, sampling, request_id=None):
                raise NotImplementedError

            async def generate_group(self, requests):
                if self.ticker is None:
                    self.ticker = asyncio.get_running_loop().create_task(self.tick())
                out = []
                for r in requests:
                    q: asyncio.Queue = asyncio.Queue()
                    self.active[r.req_id] = [q, r.sampling.max_tokens, 0]
                    out.append(self.updates(q))
                return out

            async def updates(self, q):
                while True:
                    u = await q.get()
                    yield u
                    if u.finished:
                        return

            async def tick(self):
                loop = asyncio.get_running_loop()
                t = loop.time()
                while True:
                    t += step_s
                    await asyncio.sleep(max(0.0, t - loop.time()))
                    self.steps += 1
                    for rid, st in list(self.active.items()):
                        st[2] += 1
                        last = st[2] >= st[1]
                        st[0].put_nowait(RequestUpdate(rid, [65], last, "length" if last else None, 0, 0))
                        if last:
                            del self.active[rid]

            async def abort(self, request_id):
                self.active.pop(request_id, None)

            async def health(self):
                return True

            async def check_alive(self):
                return None

            async def status(self):
                return {"steps": self.steps, "num_running": [len(self.active)]}

            async def shutdown(self):
                return None

        return PacedClient()


def _uvicorn_proc(model: str, step_ms: float, port: int) -> None:
    import uvicorn

    from raystate.serve.ingress import create_api
    from raystate.serve.server import RaystateServer

    app = create_api(RaystateServer(PacedFactory(model, step_ms)()))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start_plain_server(model: str, step_ms: float):
    """Our ASGI app over the stand-in engine under uvicorn in a process of its own: no Ray Serve."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=_uvicorn_proc, args=(model, step_ms, port))
    proc.start()
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return f"http://127.0.0.1:{port}", proc


def start_fake_server(model: str, step_ms: float) -> str:
    import socket

    import ray
    from ray import serve

    from raystate.serve.app import make_app

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = make_app({"model": model, "backend": "inprocess"}, client_factory=PacedFactory(model, step_ms))
    serve.run(app, name="profile", route_prefix="/")
    return f"http://127.0.0.1:{port}"


# -- --micro: our own per-event cost, without Ray (a stand-in client that answers at once) ----------------


def _fake_client(model: str, max_tokens: int):
    from raystate.client import Client
    from raystate.messages import RequestUpdate
    from raystate.serve.app import AppArgs

    config = AppArgs(model=model, backend="inprocess").engine_config()

    class FakeClient(Client):
        """Every request gets max_tokens updates of one token each, as fast as the consumer takes them."""

        config = property(lambda self: config)

        def generate(self, prompt_token_ids, sampling, request_id=None):
            raise NotImplementedError

        async def generate_group(self, requests):
            async def updates(rid, n):
                for i in range(n):
                    last = i == n - 1
                    yield RequestUpdate(rid, [65 + i % 26], last, "length" if last else None, 0, 0)

            return [updates(r.req_id, r.sampling.max_tokens) for r in requests]

        async def abort(self, request_id):
            return None

        async def health(self):
            return True

        async def check_alive(self):
            return None

        async def status(self):
            return {}

        async def shutdown(self):
            return None

    return FakeClient()


async def _micro(model: str, requests: int, max_tokens: int) -> dict:
    from raystate.serve.ingress import create_api
    from raystate.serve.protocol import CompletionRequest
    from raystate.serve.server import RaystateServer

    server = RaystateServer(_fake_client(model, max_tokens))
    body = {"model": server.model_name, "prompt": "x" * 128, "max_tokens": max_tokens, "stream": True}
    body.update(temperature=0, ignore_eos=True, return_token_ids=True)
    out = {}

    # 1. RaystateServer's event stream alone: request parsing, Generation, the chunk models, JSON.
    t0, events = time.perf_counter(), 0
    for _ in range(requests):
        stream = await server.completion(CompletionRequest.model_validate(body))
        try:
            async for _ev in stream:
                events += 1
        finally:
            await stream.aclose()
    out["server_stream_us_per_event"] = 1e6 * (time.perf_counter() - t0) / events

    # 2. The same through our ASGI app (FastAPI, our middlewares, SSEResponse), driven by a bare ASGI call.
    app = create_api(server)
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    headers.append((b"host", b"local"))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    t0, events = time.perf_counter(), 0
    for _ in range(requests):
        sent = [False]

        async def receive(sent=sent):
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # never disconnects

        async def send(message):
            nonlocal events
            if message["type"] == "http.response.body" and message.get("body"):
                events += 1

        await app(dict(scope), receive, send)
    out["asgi_app_us_per_event"] = 1e6 * (time.perf_counter() - t0) / events

    # 3. The poll thread's hand-over (RayClient._poll_loop -> sink -> loop.call_soon_threadsafe) of a
    # 256-request step: one call per update, as now, against one call per step.
    import threading

    loop = asyncio.get_running_loop()
    for mode in ("per_update", "per_step"):
        queues = [asyncio.Queue() for _ in range(256)]
        steps, got = 200, 0

        def producer(mode=mode, queues=queues, steps=steps):
            for _ in range(steps):
                if mode == "per_update":
                    for q in queues:
                        loop.call_soon_threadsafe(q.put_nowait, 1)
                else:
                    loop.call_soon_threadsafe(lambda qs=queues: [q.put_nowait(1) for q in qs])
                time.sleep(0.001)

        t0 = time.perf_counter()
        th = threading.Thread(target=producer)
        cpu0 = time.process_time()
        th.start()

        async def consume(q, steps=steps):
            nonlocal got
            for _ in range(steps):
                await q.get()
                got += 1

        await asyncio.gather(*(consume(q) for q in queues))
        th.join()
        cpu = time.process_time() - cpu0 - steps * 0.0  # both threads' CPU
        out[f"handover_{mode}_cpu_us_per_update"] = 1e6 * cpu / got
    out["wall_s"] = time.perf_counter() - t0
    return out


def micro(args) -> int:
    out = asyncio.run(_micro(args.model, args.micro_requests, args.max_tokens))
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--prompt-mix", default="")
    p.add_argument("--shared-prefixes", type=int, default=0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--num-replicas", type=int, default=1, help="ingress replicas (with --direct-http: one port)"
    )
    p.add_argument(
        "--py-spy", default="", help="comma-separated roles to sample (proxy,replica,scheduler,...)"
    )
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--idle", action=argparse.BooleanOptionalAction, default=False, help="py-spy --idle")
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--out", default="/tmp/profile_serve", help="folder for py-spy's raw stacks")
    p.add_argument("--json")
    p.add_argument(
        "--fake-step-ms", type=float, default=0.0, help="serve a stand-in engine stepping this often"
    )
    p.add_argument("--client-procs", type=int, default=1, help="processes for the clients")
    p.add_argument("--no-serve", action="store_true", help="with --fake-step-ms: our app under uvicorn alone")
    p.add_argument("--micro", action="store_true", help="our per-event cost without Ray (no server)")
    p.add_argument(
        "--direct-http", action="store_true", help="the replica serves HTTP itself (raystate serve's default)"
    )
    p.add_argument("--micro-requests", type=int, default=200)
    args = p.parse_args()
    if args.micro:
        return micro(args)
    mix = tuple(int(x) for x in args.prompt_mix.split(",") if x.strip())
    workload = Workload(args.prompt_len, mix, args.shared_prefixes)
    app_args = {
        "model": args.model,
        "device": args.device,
        "cluster_name": "raystate-profile",
        "max_num_seqs": args.max_num_seqs,
        "num_replicas": args.num_replicas,
    }
    plain = None
    if args.fake_step_ms and args.no_serve:
        url, plain = start_plain_server(args.model, args.fake_step_ms)
    elif args.fake_step_ms:
        url = start_fake_server(args.model, args.fake_step_ms)
    else:
        if args.direct_http:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                app_args["direct_http_port"] = sock.getsockname()[1]
        url = start_server(app_args, "profile")
        if args.direct_http:
            url = f"http://127.0.0.1:{app_args['direct_http_port']}"
    os.makedirs(args.out, exist_ok=True)
    spies = []
    try:
        procs = processes()
        procs.pop(os.getpid(), None)
        if plain is not None:
            procs[plain.pid] = "uvicorn + our app (no Serve)"
        ctx = multiprocessing.get_context("spawn")
        recv, send = ctx.Pipe(duplex=False)
        client = ctx.Process(
            target=_client_proc,
            args=(
                url,
                args.clients,
                args.duration,
                args.max_tokens,
                workload,
                args.model,
                args.client_procs,
                send,
            ),
        )
        client.start()
        time.sleep(4.0 if args.client_procs <= 1 else 10.0)  # imports and warm-up: outside the window
        cpu0 = {pid: cpu_seconds(pid) for pid in procs}
        cpu0[client.pid] = cpu_seconds(client.pid)
        threads0 = {pid: thread_cpu_seconds(pid) for pid, role in procs.items() if role in ROLES}
        me0 = time.process_time()
        t0 = time.perf_counter()
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        window = max(1, int(args.duration - 5))
        for role in filter(None, args.py_spy.split(",")):
            for pid, r in procs.items():
                if r == role:
                    path = f"{args.out}/{role}_{pid}.txt"
                    cmd = [
                        spy,
                        "record",
                        "-p",
                        str(pid),
                        "-d",
                        str(window),
                        "-r",
                        str(args.rate),
                        "--nonblocking",
                    ]
                    cmd += ["-f", "raw", "-o", path] + (["--idle"] if args.idle else [])
                    spies.append(
                        (role, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
                    )
        time.sleep(window)
        wall = time.perf_counter() - t0
        used = {pid: cpu_seconds(pid) - cpu0[pid] for pid in cpu0}
        threads = {
            pid: {t: s - before.get(t, 0.0) for t, s in thread_cpu_seconds(pid).items()}
            for pid, before in threads0.items()
        }
        served, info, _ = recv.recv()
        client.join()
        for _, _, sp in spies:
            sp.wait(timeout=60)
    finally:
        if plain is not None:
            plain.terminate()
            plain.join()
        else:
            stop_server()
    roles = dict(procs)
    if plain is not None:
        roles[plain.pid] = "uvicorn + our app (no Serve)"
    roles[client.pid] = "load generator (httpx clients)"
    if args.client_procs > 1:  # the clients ran in processes of their own: their CPU over the whole load
        used[client.pid] = info["client_cpu_s"] * wall / max(served["elapsed_s"], 1e-9)
    by_role = collections.Counter()
    for pid, s in used.items():
        by_role[roles[pid]] += s
    by_role["profile driver"] = time.process_time() - me0
    print(
        f"\n{args.clients} clients ({args.num_replicas} replica(s)), {args.max_tokens} tokens, "
        f"{workload.describe()}: "
        f"{served['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {served['ttft_p50_ms']:.1f} ms, "
        f"ITL p50 {served['itl_p50_ms']:.2f} ms, failed {served['failed']}, lost {served['lost']}"
    )
    if args.fake_step_ms:
        ideal = args.clients / args.fake_step_ms * 1e3
        print(
            f"stand-in engine, a step every {args.fake_step_ms} ms: ideal {ideal:.0f} tok/s "
            f"(served / ideal {served['output_tokens_per_s'] / ideal:.2f}), ITL p50 / step "
            f"{served['itl_p50_ms'] / args.fake_step_ms:.2f}, ITL p90 {served['itl_p90_ms']:.2f} ms, "
            f"tokens per event {served['tokens_per_event']:.2f}"
        )
    tokens = served["output_tokens_per_s"] * wall
    print(f"CPU seconds over a {wall:.1f} s window ({os.cpu_count()} cores), and per 1000 output tokens:")
    for role, s in by_role.most_common():
        if s > 0.05:
            print(
                f"  {role:<34} {s:6.2f} s  {100 * s / wall:5.1f}% of a core  {1e3 * s / tokens:6.2f} s/1k tok"
            )
    print("Busiest threads (>= 5% of a core) of our processes:")
    busiest = sorted(
        ((s, roles[pid], t) for pid, per in threads.items() for t, s in per.items() if s >= 0.05 * wall),
        reverse=True,
    )
    for s, role, t in busiest:
        print(f"  {role:<12} {t:<28} {100 * s / wall:5.1f}% of a core")
    report = {
        "served": {k: v for k, v in served.items() if not k.startswith("_")},
        "cpu_s": dict(by_role),
        "threads_cpu_s": [{"role": r, "thread": t, "cpu_s": s} for s, r, t in busiest],
    }
    for role, path, sp in spies:
        print(f"\npy-spy {role} ({path}):")
        if sp.returncode or not os.path.exists(path):
            print("    failed: " + sp.stderr.read().decode(errors="replace")[-400:])
            continue
        print("\n".join(fold(path, args.top)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
