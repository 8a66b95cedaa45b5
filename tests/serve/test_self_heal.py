"""Issue 13, point 2: a dead step loop is unhealthy, and the server heals itself.

The scheduler's step loop is killed (the actor stays up and still answers `status()`): /health answers
503 with no traceback, Serve's replica check (`check_alive`) fails, Serve replaces the replica, the new
replica replaces the dead deployment, and the same URL serves completions again, nobody restarting
anything by hand."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from serve_harness import App

pytestmark = pytest.mark.slow

CLUSTER = "raystate-heal-test"


@pytest.fixture
def heal_app(serve_port):
    from ray import serve

    from raystate import launch
    from raystate.serve.app import build_app

    args = {"model": "tiny", "cluster_name": CLUSTER, "health_check_period_s": 1.0}
    serve.run(build_app(args), name="heal", route_prefix="/heal")
    try:
        yield App(f"http://127.0.0.1:{serve_port}/heal", None)
    finally:
        serve.delete("heal")
        launch.stop(CLUSTER)


def _complete(app: App) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{app.v1}/completions", json=body, timeout=30)


def test_dead_step_loop_fails_health_and_serve_replaces_it(heal_app):
    assert _complete(heal_app).status_code == 200
    first = ray.get_actor("scheduler", namespace=CLUSTER)
    first.inject_fault.remote("step_loop")
    # Unhealthy at once: /health runs a real step, which a dead loop cannot.
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(f"{heal_app.url}/health", timeout=30)
        if r.status_code == 503:
            break
        assert time.monotonic() < deadline, "/health kept passing after the step loop died"
        time.sleep(0.2)
    assert "Traceback" not in r.text and ".py" not in r.text
    # Healed without a hand: a new deployment behind a new replica, the same URL.
    t0 = time.monotonic()
    while True:
        try:
            ok = httpx.get(f"{heal_app.url}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            break
        assert time.monotonic() - t0 < 180, "the server did not heal within 180 s"
        time.sleep(0.5)
    healed_s = time.monotonic() - t0
    r = _complete(heal_app)
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
    second = ray.get_actor("scheduler", namespace=CLUSTER)
    assert second != first
    print(f"healed in {healed_s:.1f} s")
