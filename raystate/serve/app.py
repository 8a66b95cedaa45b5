"""`build_app(args)`: the Ray Serve application (an `import_path` target for `serve run` / `serve deploy`).

This is the one place that knows deployment options. The ingress deployment is a plain class around an
injected client factory: by default it connects to (or starts) the named raystate cluster of the Ray
backend; `backend: local` runs the in-process engine inside the replica; a test may pass any picklable
zero-argument callable that returns a `Client`. The factory runs in the replica, so nothing heavy (torch,
the model) is imported where the application is built.

    serve run raystate.serve.app:build_app model=tiny num_shards=1
    serve run deploy/serve_config.yaml
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from raystate.client import Client
from raystate.config import CacheConfig, EngineConfig, SchedulerConfig
from raystate.errors import InvalidRequest
from raystate.serve.ingress import DEFAULT_MAX_BODY_BYTES, create_api
from raystate.serve.server import RaystateServer

API_KEY_ENV = "RAYSTATE_API_KEY"
DEPLOYMENT_NAME = "RaystateOpenAI"

ClientFactory = Callable[[], Client | Awaitable[Client]]


class AppArgs(BaseModel):
    """The application's arguments (`args:` of a Serve config; `key=value` words of `serve run`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny"  # a named model (tiny, bench) or a save_pretrained directory
    served_model_name: str | None = None  # the id clients send as `model`; default: the model's name
    backend: Literal["ray", "local"] = "ray"
    cluster_name: str = "raystate"  # the Ray backend's cluster: connected to if it runs, else started
    num_shards: int = Field(1, ge=1)
    device: str = "cpu"
    dtype: str = "auto"
    cuda_graphs: bool = True
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int | None = None
    kv_cache_bytes: int | None = Field(None, ge=1)  # per shard; None: sized from max_num_seqs
    enable_prefix_caching: bool = True
    swa_bounded_replay: bool = True
    share_replay: bool = True  # one window rebuild per replayed hit per step (KVManager.admit_chunk)
    seed: int = 0
    api_key: str | None = None  # None: RAYSTATE_API_KEY in the replica's environment, if set
    require_api_key: bool = False  # fail the replica rather than serve without a key
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    num_replicas: int = Field(1, ge=1)
    # Batching happens in the engine, so the ingress must admit every stream it is given at once.
    max_ongoing_requests: int = Field(1024, ge=1)

    def engine_config(self) -> EngineConfig:
        from raystate.llm import resolve_model_config

        model, path = resolve_model_config(self.model, self.max_model_len)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                kv_cache_bytes=self.kv_cache_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                swa_bounded_replay=self.swa_bounded_replay,
                share_replay=self.share_replay,
            ),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs),
            device=self.device,
            dtype=self.dtype,
            cuda_graphs=self.cuda_graphs,
            seed=self.seed,
            model_path=path,
        )


@dataclass(frozen=True)
class LocalBackend:
    """The in-process engine inside the replica (one replica, no Ray actors of its own)."""

    config: EngineConfig

    def __call__(self) -> Client:
        from raystate.client import LocalClient

        return LocalClient(self.config)


@dataclass(frozen=True)
class RayBackend:
    """The Ray backend's deployment `name`: connected to when it runs, else started here with `num_shards`.

    A replica that starts the deployment owns it (its actors live as long as the replica, and its client's
    shutdown stops them); replicas that connect only close their client.
    """

    config: EngineConfig
    name: str
    num_shards: int

    def __call__(self) -> Client:
        from raystate.cluster import Cluster

        try:
            return Cluster.connect(self.name)
        except InvalidRequest:  # no deployment of that name yet
            pass
        try:
            return Cluster.start(self.config, name=self.name, num_shards=self.num_shards)
        except InvalidRequest as e:  # another replica started it in the meantime
            if e.field != "name":
                raise
            return Cluster.connect(self.name)


class OpenAIIngress:
    """The deployment class: builds the client in the replica, then serves the FastAPI app over it."""

    async def __init__(
        self,
        client_factory: ClientFactory,
        model_name: str | None,
        api_key: str | None,
        require_api_key: bool,
        max_body_bytes: int,
    ) -> None:
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if require_api_key and not api_key:
            raise RuntimeError(f"require_api_key is set but neither api_key nor ${API_KEY_ENV} is given")
        # Starting a backend blocks (placement, model load): off the replica's event loop.
        client = await asyncio.to_thread(client_factory)
        if inspect.isawaitable(client):
            client = await client
        self._server = RaystateServer(client, model_name)
        self._api_key = api_key
        self._max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        return create_api(self._server, self._api_key, self._max_body_bytes)

    async def check_health(self) -> None:
        """Serve's periodic replica check: the backend must answer (the cheap status call, not a step)."""
        await self._server.status()

    async def __del__(self) -> None:
        server = getattr(self, "_server", None)  # None when __init__ failed
        if server is not None:
            await server.shutdown()


def build_app(args: dict[str, Any] | AppArgs | None = None):
    """The Serve application of `args` (the application builder Serve calls with one dict)."""
    return make_app(args)


def make_app(args: dict[str, Any] | AppArgs | None = None, client_factory: ClientFactory | None = None):
    """`build_app` with an injected client: `client_factory` (programmatic use, tests) replaces the
    backend `args` describe; it must pickle, since it runs in the replica."""
    opts = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    if client_factory is None:
        config = opts.engine_config()
        if opts.backend == "local":
            client_factory = LocalBackend(config)
        else:
            client_factory = RayBackend(config, opts.cluster_name, opts.num_shards)
    deployment = serve.deployment(
        serve.ingress()(OpenAIIngress),
        name=DEPLOYMENT_NAME,
        num_replicas=opts.num_replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        # The model runs in the backend's actors (or, with backend local, on the replica's threads).
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=10,
        health_check_timeout_s=60,
    )
    return deployment.bind(
        client_factory, opts.served_model_name, opts.api_key, opts.require_api_key, opts.max_body_bytes
    )
