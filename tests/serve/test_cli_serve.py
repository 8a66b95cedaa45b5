"""`raystate serve` in the foreground: a local Ray of its own, the URL printed, Ctrl-C stops it cleanly.

The serve test runs before the shared Ray session of tests/serve starts (file order), as a user would:
a subprocess. The bench test loads the session's app through --url.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_harness import free_port

pytestmark = pytest.mark.slow  # each test starts `raystate serve` (a local Ray and a Serve app)

KEY = "cli-test-key"


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _wait_for(lines: queue.Queue, needle: str, timeout_s: float) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} not printed in {timeout_s} s; output: {''.join(seen)}")


def _start_serve(port: int, args: list[str], **popen) -> tuple[subprocess.Popen, queue.Queue]:
    """`raystate serve --port PORT ARGS` (reference kernels, no API key from the environment), and a queue
    its output lines (stdout and stderr: a failed start says why) arrive on."""
    env = {**os.environ, "RAYSTATE_KERNELS": "reference", "PYTHONUNBUFFERED": "1"}
    env.pop("RAYSTATE_API_KEY", None)
    cmd = [sys.executable, "-m", "raystate", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **popen
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    return proc, lines


def test_serve_prints_url_serves_and_stops_on_ctrl_c():
    port = free_port()
    # Two ingress replicas: with direct HTTP (the default) both listen on the port (SO_REUSEPORT). No
    # Ray dashboard: its line is printed only when the local Ray starts one.
    # --ray-options reach the deployment the CLI starts beside Serve (status says "pipelined").
    flags = ["--api-key", KEY, "--name", "cli", "--num-replicas", "2", "--no-ray-dashboard"]
    flags += ["--ray-options", '{"pipeline_steps": true, "step_timeout_s": 90}']
    flags += ["--served-model-name", "tiny-cli"]  # what clients send as "model"
    proc, lines = _start_serve(port, flags)
    try:
        out = "".join(_wait_for(lines, "Ctrl-C", timeout_s=180))
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in out
        assert "2 ingress replica(s)" in out and "shard 0 start-up: weights" in out
        assert "curl" in out and "Authorization: Bearer" in out and '"model": "tiny-cli"' in out
        assert "serving model 'tiny-cli'" in out
        assert "Ray dashboard" not in out  # --no-ray-dashboard: the local Ray started without it

        body = {"model": "tiny-cli", "prompt": "F1 cli", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert r.json()["model"] == "tiny-cli"
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=60).json()
        assert [card["id"] for card in models["data"]] == ["tiny-cli"]
        r = httpx.post(f"{url}/v1/completions", json={**body, "model": "tiny"}, headers=auth, timeout=60)
        assert r.status_code == 404 and "tiny-cli" in r.text  # the --model word is not an alias

        status = subprocess.run(
            [sys.executable, "-m", "raystate", "status", "--url", url, "--api-key", KEY],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "backend: ray" in status.stdout and "shards: 1" in status.stdout
        assert "dispatch: compiled, pipelined" in status.stdout

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        rest = "".join(_wait_for(lines, "stopped", timeout_s=5))
        assert "SIGINT" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(f"{url}/health", timeout=5)


def test_sigterm_to_the_whole_process_group_stops_without_waiting_on_the_dead_ray():
    """GNU `timeout` and systemd's KillMode=control-group signal the whole group: the local Ray's daemons
    and replicas die with the server, so there is nothing to drain. The server says so and stops; before,
    it waited out a 30 s drain call and then a minute of the core worker retrying the GCS, and crashed."""
    # its own session: the group is the server and its Ray
    proc, lines = _start_serve(
        free_port(), ["--name", "cli-group", "--no-ray-dashboard"], start_new_session=True
    )
    try:
        _wait_for(lines, "Ctrl-C", timeout_s=180)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        rest = "".join(_wait_for(lines, "stopped", timeout_s=5))
        assert "SIGTERM" in rest and "exited on the same signal" in rest and "no drain" in rest
        assert "draining" not in rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_refuses_a_port_another_server_listens_on():
    """Another raystate's replicas listen with SO_REUSEPORT, which would let ours join their port and
    split the connections between two servers: the CLI refuses the port before starting Ray."""
    from raystate.serve.direct_http import reuse_port_socket

    port = free_port()
    env = {**os.environ, "RAYSTATE_KERNELS": "reference"}
    cmd = [sys.executable, "-m", "raystate", "serve", "--port", str(port), "--name", "cli-port"]
    with reuse_port_socket("127.0.0.1", port):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"port {port} on 127.0.0.1 is in use" in r.stderr
    assert "Started a local Ray" not in r.stdout + r.stderr


def test_status_reports_an_unreachable_server():
    r = subprocess.run(
        [sys.executable, "-m", "raystate", "status", "--url", f"http://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "cannot read status" in r.stderr


def test_bench_against_the_running_app(open_app, tmp_path):
    """`raystate bench` on a server that runs already (--url): load, table, JSON and PNG."""
    plot, figures = tmp_path / "bench.png", tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "raystate", "bench", "--url", open_app.url, "--backend", "inprocess"]
    cmd += [
        "--clients",
        "4",
        "--duration",
        "2",
        "--max-tokens",
        "4",
        "--plot",
        str(plot),
        "--json",
        str(figures),
    ]
    env = {**os.environ, "RAYSTATE_KERNELS": "reference"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "requests/s" in r.stdout and "tokens/s served / LLM.generate" in r.stdout
    data = json.loads(figures.read_text())
    (run,) = data["runs"]
    served = run["served"]
    assert served["completed"] > 0 and served["failed"] == 0 and served["lost"] == 0
    assert run["llm_generate"]["requests"] == served["completed"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
