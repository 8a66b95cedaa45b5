"""One Ray session and one Serve instance for every test of tests/serve (package scope), on loopback.

Two apps share it: "open" (no API key) and "keyed" (an API key), each at its own route prefix on the same
free port. Both run over the Ray backend, the keyed app connecting to the deployment the open app's
replica started; the engine runs the kernels' PyTorch references (under Triton's CPU
interpreter a step would take seconds), set in the environment before Ray starts so every Ray process
inherits it. `reference` generates the same prompts through plain `LLM.generate` on the in-process
engine: an oracle independent of Ray and Serve.
"""

from __future__ import annotations

import uuid

import pytest
from serve_harness import App, free_port

API_KEY = "test-key-" + uuid.uuid4().hex
BACKEND = "ray"
CLUSTER = "raystate-serve-tests"
RAY_OPTIONS = {"pipeline_steps": True, "step_timeout_s": 90.0}
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="package")
def serve_port():
    import ray
    from ray import serve

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")
        mp.setattr("raystate.kernels._common._reference_forced", True)
        if ray.is_initialized():  # a session earlier tests left: ours must inherit the environment above
            ray.shutdown()
        ray.init(address="local", include_dashboard=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            yield port
        finally:
            serve.shutdown()
            ray.shutdown()


def _deploy(port: int, name: str, api_key: str | None) -> App:
    from ray import serve

    from raystate.serve.app import build_app

    args = {
        "model": "tiny",
        "backend": BACKEND,
        "cluster_name": CLUSTER,
        "api_key": api_key,
        "ray_options": RAY_OPTIONS,  # the keyed app connects to the open app's deployment: unused there
    }
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    return App(f"http://127.0.0.1:{port}/{name}", api_key)


@pytest.fixture(scope="package")
def open_app(serve_port) -> App:
    return _deploy(serve_port, "open", None)


@pytest.fixture(scope="package")
def keyed_app(serve_port, open_app) -> App:
    return _deploy(serve_port, "keyed", API_KEY)


@pytest.fixture(scope="package")
def reference(serve_port):
    """fn(prompts, max_tokens, ignore_eos=False) -> [(token_ids, text, finish_reason)], greedy, through
    plain LLM.generate."""
    from raystate import LLM, SamplingParams

    llm = LLM(model="tiny", max_model_len=MAX_MODEL_LEN, backend="inprocess")

    def generate(
        prompts: list[str], max_tokens: int, ignore_eos: bool = False
    ) -> list[tuple[list[int], str, str]]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAYSTATE_KERNELS", "reference")
            mp.setattr("raystate.kernels._common._reference_forced", True)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.token_ids, o.text, o.finish_reason) for o in outs]

    return generate
