"""deploy/: every file parses and has the keys its consumer needs; the Serve config really deploys.

The Serve config is run as a user runs it (`serve run deploy/serve_config.yaml`, its own local Ray) with
only the HTTP port changed to a free one, and answers a completion. The `ray up` cluster file is checked
against Ray's own autoscaler schema, the KubeRay manifest's Serve config against Serve's schema, and the
launch scripts with `bash -n` and their --dry-run flag.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.serve.schema import ServeDeploySchema

from raystate.serve.app import DEPLOYMENT_NAME, AppArgs

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
IMPORT_PATH = "raystate.serve.app:build_app"


def _load(name: str) -> dict:
    with open(DEPLOY / name) as f:
        return yaml.safe_load(f)


def _check_serve_config(config: dict) -> ServeDeploySchema:
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == IMPORT_PATH
    AppArgs.model_validate(app.args)  # every argument is one build_app knows
    assert [d.name for d in app.deployments] == [DEPLOYMENT_NAME]
    return schema


def test_serve_config_schema():
    schema = _check_serve_config(_load("serve_config.yaml"))
    assert schema.http_options.host == "127.0.0.1"  # loopback unless told otherwise
    assert schema.applications[0].args["backend"] == "ray"


def test_cluster_yaml_matches_ray_up_schema():
    config = _load("cluster.yaml")
    with open(Path(ray.autoscaler.__file__).parent / "ray-schema.json") as f:
        jsonschema.validate(config, json.load(f))
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert workers and all(t["max_workers"] >= t["min_workers"] >= 1 for t in workers)
    assert any("raystate" in cmd and "pip install" in cmd for cmd in config["setup_commands"])
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)  # token auth stays on
    assert "~/.ray/auth_token" in config["file_mounts"]
    assert any("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"])


def test_kuberay_rayservice_manifest():
    manifest = _load("kuberay/rayservice.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    spec = manifest["spec"]
    serve_config = _check_serve_config(yaml.safe_load(spec["serveConfigV2"]))
    assert serve_config.applications[0].args["require_api_key"] is True
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            assert "secretKeyRef" in env["RAYSTATE_API_KEY"]["valueFrom"]  # the key never sits in the file
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) >= 1


def _script(name: str, *args: str, home: Path) -> subprocess.CompletedProcess:
    # No `ray` on PATH and an empty HOME: a dry run must not need either.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    return subprocess.run(
        ["bash", str(DEPLOY / name), *args], capture_output=True, text=True, env=env, timeout=30
    )


@pytest.mark.parametrize("name", ["launch-head.sh", "launch-worker.sh"])
def test_launch_scripts_parse(name):
    assert subprocess.run(["bash", "-n", str(DEPLOY / name)], capture_output=True).returncode == 0
    assert os.access(DEPLOY / name, os.X_OK)


def test_launch_head_dry_run(tmp_path):
    r = _script("launch-head.sh", "--dry-run", "--num-gpus", "8", home=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert lines[0] == "+ ray get-auth-token --generate"  # no token yet: one is made
    assert lines[1].startswith("+ ray start --head --port 6379 --dashboard-host 127.0.0.1")
    assert "--num-gpus 8" in lines[1]
    assert lines[2].startswith("+ serve deploy ") and lines[2].endswith("--address http://127.0.0.1:8265")
    assert not (tmp_path / ".ray").exists()


def test_launch_worker_dry_run(tmp_path):
    r = _script("launch-worker.sh", "--dry-run", "--head", "10.0.0.1:6379", home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "+ ray start --address 10.0.0.1:6379" in r.stdout
    assert "RAY_AUTH_TOKEN" in r.stderr  # warns that a real run needs the head's token
    missing = _script("launch-worker.sh", "--dry-run", home=tmp_path)
    assert missing.returncode == 2 and "--head" in missing.stderr
    assert _script("launch-worker.sh", "--bogus", home=tmp_path).returncode == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_config_deploys_on_a_local_ray(tmp_path):
    config = _load("serve_config.yaml")
    port = _free_port()
    config["http_options"]["port"] = port
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    env = {**os.environ, "RAYSTATE_KERNELS": "reference"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [str(serve_cli), "run", str(path), "--address", "local"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "serve run exited"
            try:
                if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the app never became healthy"
            time.sleep(1.0)
        body = {"model": "tiny", "prompt": "G1 config", "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{url}/status", timeout=30).json()["backend"] == "ray"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
