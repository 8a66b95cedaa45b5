"""`build_app(args)`: the Ray Serve application (an `import_path` target for `serve run` / `serve deploy`).

This is the one place that knows deployment options. The ingress deployment is a plain class around an
injected client factory: by default it connects to (or starts) the named raystate cluster of the Ray
backend; `backend: inprocess` runs the in-process engine inside the replica; a test may pass any picklable
zero-argument callable that returns a `Client`. The factory runs in the replica, so nothing heavy (torch,
the model) is imported where the application is built.

    serve run raystate.serve.app:build_app model=tiny num_shards=1
    serve run raystate.serve.app:build_app model=/models/Qwen3-0.6B backend=inprocess
    serve run deploy/serve_config.yaml
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, create_model, field_validator, model_validator
from ray import serve

from raystate.client import Client
from raystate.config import EngineConfig
from raystate.engine_args import Backend, EngineArgs, build_engine_config, knobs
from raystate.errors import InvalidRequest
from raystate.serve.ingress import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_CORS_HEADERS,
    DEFAULT_CORS_METHODS,
    DEFAULT_MAX_BODY_BYTES,
    create_api,
)
from raystate.serve.reasoning import REASONING_PARSERS
from raystate.serve.server import DRAIN_CUT_MARGIN_S, RaystateServer
from raystate.serve.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAYSTATE_API_KEY"
DEPLOYMENT_NAME = "RaystateOpenAI"
DEFAULT_SHUTDOWN_GRACE_S = 30.0
DRAIN_NAMESPACE = "raystate"  # the Ray namespace of DrainNotice actors
START_WAIT_S = 900.0  # how long a replica waits for a backend another process is starting

ClientFactory = Callable[[], Client | Awaitable[Client]]


def _engine_fields() -> dict[str, Any]:
    """EngineArgs' fields as pydantic fields: same names, types and defaults, their help as description."""
    return {k.name: (k.annotation, Field(k.default, description=k.help)) for k in knobs()}


# The engine half of AppArgs, generated so that the Serve args cannot drift from LLM's and the CLI's knobs.
# Pydantic checks the types; the values are checked where LLM's are, when `build_engine_config` builds the
# config (make_app does it before the deployment starts): errors name the field and the limit.
_EngineFields = create_model(
    "_EngineFields", __config__=ConfigDict(extra="forbid"), __module__=__name__, **_engine_fields()
)


class AppArgs(_EngineFields):
    """The application's arguments (`args:` of a Serve config; `key=value` words of `serve run`): every
    `raystate.engine_args.EngineArgs` field (model, device, max_num_seqs, kv_cache_bytes, block_size, ...),
    then these."""

    model_config = ConfigDict(extra="forbid")

    # The id clients send as `model` and responses carry; default: the `model` word as given (a named
    # model, a checkpoint folder or a hub id).
    served_model_name: str | None = None
    # A chat template in place of the checkpoint's (vLLM's --chat-template): a file's path or the template
    # text; read and compiled where the args are read, so the replicas get the text (no file on their
    # nodes) and a bad template fails the config, not the first chat request.
    chat_template: str | None = None
    # Render a chat request's own `chat_template` in place of the server's (vLLM's
    # --trust-request-chat-template); off: such a request is a 400, since a template runs in the replica.
    trust_request_chat_template: bool = False
    # How the model writes tool calls in free text, for tool_choice "auto": "auto", the format its chat
    # template writes if raystate knows it; "hermes" (<tool_call> blocks: Qwen2.5, Qwen3, Hermes);
    # "llama3_json" (Llama 3.1-3.3's bare JSON calls); "none":
    # tool_choice "auto" is refused (forced calls, through the grammar, still work).
    tool_call_parser: Literal["auto", "none", *TOOL_CALL_PARSERS] = "auto"
    # How the model marks its thinking: "qwen3", "deepseek_r1" (<think> ... </think>) send it as the
    # message's reasoning_content; "none" (default, as vLLM's): it stays in the content.
    reasoning_parser: Literal["none", *REASONING_PARSERS] = "none"
    backend: Backend = "ray"
    cluster_name: str = "raystate"  # the Ray backend's cluster: connected to if it runs, else started
    num_shards: int = Field(1, ge=1)
    # The Ray backend's launch options when a replica starts its deployment: `raystate.launch.LaunchOptions`
    # fields (dispatch, pipeline_steps, placement_strategy, step_timeout_s, worker_env, ...), as
    # `LLM(ray_options=...)` takes them; the name and shard count are cluster_name and num_shards.
    ray_options: dict[str, Any] = Field(default_factory=dict)
    api_key: str | None = None  # None: RAYSTATE_API_KEY in the replica's environment, if set
    require_api_key: bool = False  # fail the replica rather than serve without a key
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024)
    body_timeout_s: float = Field(DEFAULT_BODY_TIMEOUT_S, gt=0)  # 408 when the body takes longer
    # Host header allow-list ("name", "*.domain", "*"; a port is ignored); empty: any Host.
    allowed_hosts: list[str] = Field(default_factory=list)
    # Origins whose web pages may call the API (CORS); empty: none, and no CORS headers at all.
    cors_allow_origins: list[str] = Field(default_factory=list)
    cors_allow_methods: list[str] = Field(default_factory=lambda: list(DEFAULT_CORS_METHODS))
    cors_allow_headers: list[str] = Field(default_factory=lambda: list(DEFAULT_CORS_HEADERS))
    # On shutdown, how long running requests (streams included) may still run before they are cut:
    # `raystate serve` drains for this long; Serve's own replica shutdown waits this long plus a margin.
    shutdown_grace_s: float = Field(DEFAULT_SHUTDOWN_GRACE_S, ge=0)
    num_replicas: int = Field(1, ge=1)
    # Batching happens in the engine, so the ingress must admit every stream it is given at once.
    max_ongoing_requests: int = Field(1024, ge=1)
    # Serve's replica check (`check_alive`: a dead step loop fails it and the replica is replaced).
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    # Direct HTTP (raystate/serve/direct_http.py): each replica serves the API itself on this port (shared
    # by the replicas of a node), without Serve's proxy; None: through Serve's proxy.
    direct_http_port: int | None = Field(None, ge=1, le=65535)
    direct_http_host: str = "127.0.0.1"

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value: str | None) -> str | None:
        from raystate.hf.chat_template import read_chat_template

        return None if value is None else read_chat_template(value)

    @field_validator("ray_options")
    @classmethod
    def _launch_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """Checked here, where the config is read: a bad one names its field in the error."""
        from raystate.field_types import check_names
        from raystate.launch import LaunchOptions

        for fixed in ("name", "num_shards"):
            if fixed in options:
                limit = "set by cluster_name and num_shards (--name, --num-shards)"
                raise InvalidRequest(f"ray_options.{fixed}", limit, fixed)
        check_names(LaunchOptions, options, "a launch option")
        LaunchOptions(**options)
        return options

    @model_validator(mode="after")
    def _ray_options_need_the_ray_backend(self) -> AppArgs:
        if self.ray_options and self.backend != "ray":
            raise InvalidRequest("ray_options", "none with backend inprocess", sorted(self.ray_options))
        return self

    def engine_args(self) -> EngineArgs:
        return EngineArgs(**self.model_dump(include=set(_EngineFields.model_fields)))

    def engine_config(self) -> EngineConfig:
        return build_engine_config(self.engine_args())


@dataclass(frozen=True)
class InProcessBackend:
    """The in-process engine inside the replica (one replica, no Ray actors of its own)."""

    config: EngineConfig

    def __call__(self) -> Client:
        from raystate.client import InProcessClient

        return InProcessClient(self.config)


@dataclass(frozen=True)
class RayBackend:
    """The Ray backend's deployment `name`: connected to when it runs, else started here with `num_shards`.

    A replica that starts the deployment owns it (its actors live as long as the replica, and its client's
    shutdown stops them); replicas that connect only close their client.
    """

    config: EngineConfig
    name: str
    num_shards: int
    ray_options: dict[str, Any] = field(default_factory=dict)  # LaunchOptions fields

    def __call__(self) -> Client:
        import ray

        from raystate import launch
        from raystate.cluster import Cluster

        try:
            cluster = Cluster.connect(self.name)
        except InvalidRequest:  # no deployment of that name yet
            if launch.wait_started(self.name, START_WAIT_S):  # `raystate serve` is starting it
                return Cluster.connect(self.name)
        else:
            try:
                ray.get(cluster.scheduler.check_alive.remote(), timeout=30)
                return cluster
            except Exception as e:  # its step loop died (or it is gone): replace it
                logger.warning("deployment %r is not alive (%s); starting a new one", self.name, e)
                cluster.close()
                launch.stop(self.name)
        try:
            return Cluster.start(self.config, name=self.name, num_shards=self.num_shards, **self.ray_options)
        except InvalidRequest as e:  # another replica started it in the meantime
            if e.field != "name":
                raise
            return Cluster.connect(self.name)


def drain_notice_name(app_name: str) -> str:
    return f"raystate-drain:{app_name}"


class DrainNotice:
    """`raystate serve`'s shutdown, told to every replica of its application (a Ray actor, by name).

    Why an actor: the CLI knows when it is signalled, but a Serve handle call reaches one replica, not
    all of them, and Serve itself tells a replica nothing when it starts stopping it (`__del__` runs only
    after Serve's own wait). So the CLI creates this actor before the application, each replica looks it
    up when it starts and waits on it, and the CLI then waits for every replica's `drained` report.
    """

    def __init__(self) -> None:
        self._grace_s: float | None = None
        self._changed = asyncio.Event()
        self._drained: set[str] = set()

    async def drain(self, grace_s: float) -> None:
        """Starts the drain, or moves its cut earlier (a shorter grace; a second Ctrl-C sends 0)."""
        if self._grace_s is None or grace_s < self._grace_s:
            self._grace_s = grace_s
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait(self, shorter_than: float | None = None) -> float:
        """The grace period once a drain starts (or, given `shorter_than`, once it is shorter)."""
        while self._grace_s is None or (shorter_than is not None and self._grace_s >= shorter_than):
            await self._changed.wait()
        return self._grace_s

    def drained(self, replica: str) -> None:
        self._drained.add(replica)

    def num_drained(self) -> int:
        return len(self._drained)


def _find_drain_notice() -> tuple[Any, str] | None:
    """This replica's DrainNotice and its replica id; None outside `raystate serve` (serve run/deploy)."""
    import ray

    try:
        context = serve.get_replica_context()
        return ray.get_actor(drain_notice_name(context.app_name), DRAIN_NAMESPACE), str(context.replica_id)
    except Exception:  # not in a replica, or no notice actor: Serve's own replica shutdown only
        return None


class OpenAIIngress:
    """The deployment class: builds the client in the replica, then serves the FastAPI app over it."""

    async def __init__(
        self,
        client_factory: ClientFactory,
        model_name: str | None,
        api_key: str | None,
        require_api_key: bool,
        max_body_bytes: int,
        http_guards: dict[str, Any] | None = None,
        direct_http: tuple[str, int] | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "none",
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
    ) -> None:
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if require_api_key and not api_key:
            raise RuntimeError(f"require_api_key is set but neither api_key nor ${API_KEY_ENV} is given")
        # Starting a backend blocks (placement, model load): off the replica's event loop.
        client = await asyncio.to_thread(client_factory)
        if inspect.isawaitable(client):
            client = await client
        parser = None if tool_call_parser == "none" else tool_call_parser
        self._server = RaystateServer(
            client,
            model_name,
            tool_call_parser=parser,
            reasoning_parser=None if reasoning_parser == "none" else reasoning_parser,
            chat_template=chat_template,
            trust_request_chat_template=trust_request_chat_template,
        )
        self._api_key = api_key
        self._max_body_bytes = max_body_bytes
        self._http_guards = dict(http_guards or {})
        self._direct = None
        if direct_http is not None:  # this replica answers HTTP itself (direct_http.py)
            from raystate.serve.direct_http import DirectHTTPServer

            self._direct = DirectHTTPServer(self.__serve_build_asgi_app__(), *direct_http)
            await self._direct.start()
        notice = _find_drain_notice()
        # Requests run on this event loop, so the drain (which reschedules their timeouts) must too.
        self._drain_task = None if notice is None else asyncio.create_task(self._follow_drain(*notice))

    def __serve_build_asgi_app__(self):
        return create_api(self._server, self._api_key, self._max_body_bytes, **self._http_guards)

    async def _follow_drain(self, notice, replica_id: str) -> None:
        """Drains this replica when `raystate serve` is stopped (DrainNotice), then reports it drained."""
        try:
            grace_s = await notice.wait.remote()
            self._server.begin_drain(grace_s)
            drained = asyncio.ensure_future(self._server.wait_drained())
            while True:  # a shorter grace (a second Ctrl-C) moves the cut earlier
                shorter = asyncio.ensure_future(notice.wait.remote(grace_s))
                await asyncio.wait({drained, shorter}, return_when=asyncio.FIRST_COMPLETED)
                if drained.done():
                    shorter.cancel()
                    break
                grace_s = shorter.result()
                self._server.begin_drain(grace_s)
            if not drained.result():
                logger.warning("drain: %d requests still open after the cut", self._server.in_flight)
            await notice.drained.remote(replica_id)
        except Exception as e:  # the CLI (and its notice actor) went away: Serve's shutdown takes over
            logger.warning("drain notice lost: %r", e)

    async def check_health(self) -> None:
        """Serve's periodic replica check: raises unless the backend's step loop runs (a cheap call, not
        a step), so Serve replaces a replica whose engine died; the new replica's `RayBackend` then
        replaces the dead deployment."""
        await self._server.client.check_alive()

    async def __del__(self) -> None:
        direct = getattr(self, "_direct", None)
        if direct is not None:
            await direct.stop()
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
    model_name = opts.served_model_name
    if client_factory is None:
        model_name = model_name or opts.model
        config = opts.engine_config()
        if config.tokenizer_path is not None:
            # A tokenizer given apart is loaded here too, so that one that does not fit the model (ids past
            # its vocabulary, an unreadable tokenizer.json) fails the config, not every replica's start.
            from raystate.serve.text import model_text_for_config

            model_text_for_config(config)
        if opts.backend == "inprocess":
            client_factory = InProcessBackend(config)
        else:
            client_factory = RayBackend(config, opts.cluster_name, opts.num_shards, opts.ray_options)
    deployment = serve.deployment(
        serve.ingress()(OpenAIIngress),
        name=DEPLOYMENT_NAME,
        num_replicas=opts.num_replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        # The model runs in the backend's actors (or, with backend inprocess, on the replica's threads).
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=opts.health_check_timeout_s,
        # Serve's own replica shutdown (serve deploy's updates, serve.delete, scaling down) waits for the
        # replica's requests, streams included, this long before it kills the replica; checking every
        # half second lets a replica go as soon as its last stream ends. Serve tells the replica nothing
        # when that wait starts, so streams still open at the kill are cut without an error event, and
        # `serve shutdown` (serve run's Ctrl-C) stops Serve's proxy at once, cutting every connection.
        # `raystate serve` therefore drains the replicas itself first (DrainNotice).
        graceful_shutdown_timeout_s=opts.shutdown_grace_s + DRAIN_CUT_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.5,
    )
    http_guards = {
        "body_timeout_s": opts.body_timeout_s,
        "allowed_hosts": opts.allowed_hosts,
        "cors_allow_origins": opts.cors_allow_origins,
        "cors_allow_methods": opts.cors_allow_methods,
        "cors_allow_headers": opts.cors_allow_headers,
    }
    return deployment.bind(
        client_factory,
        model_name,
        opts.api_key,
        opts.require_api_key,
        opts.max_body_bytes,
        http_guards,
        None if opts.direct_http_port is None else (opts.direct_http_host, opts.direct_http_port),
        opts.tool_call_parser,
        opts.reasoning_parser,
        opts.chat_template,
        opts.trust_request_chat_template,
    )
