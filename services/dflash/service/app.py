"""The Ray Serve application: [ingress ->] verifier deployment [-> drafter deployment (disaggregated)].

`build(args)` is the application builder the Helm chart's serveConfigV2 points at
(`import_path: dflash.service.app:build`, `args:` = the ServiceConfig tree). The public gRPC port is
Ray Serve's gRPC proxy, started with `grpc_options()`; the application's ingress implements
dflash.v1.Generation, grpc.health.v1.Health (open: probes carry no token) and server reflection
(behind the token when auth is on), registered by servicers.py so that undecodable bytes reach it and
get INVALID_ARGUMENT. That ingress is the verifier deployment itself (`ingress_placement: verifier`,
the default: the proxy streams straight from the replica that decodes) or a deployment of its own
that relays the verifier's stream (`separate`). Drafter replicas serve the internal Drafter API on
their own ports, behind the shared drafter_net token, and advertise them in Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import Application
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from ..api.v1 import generate_pb2
from .config import ConfigError, ServiceConfig
from .consumers import Consumer, ConsumerWatch
from .health import ServingCheck, VerifierLease
from .ingress import Ingress, Rejected, check_decoded
from .messages import MalformedMessage, StreamError, VerifyRequest
from .metrics import ServiceMetrics
from .session_store import SessionStore, open_store

if TYPE_CHECKING:
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2
    from ray.serve.config import gRPCOptions
    from ray.serve.grpc_util import RayServegRPCContext

SERVICERS = (
    "dflash.service.servicers.add_GenerationServicer_to_server",
    "dflash.service.servicers.add_HealthServicer_to_server",
)
REFLECTION = "dflash.service.servicers.add_ServerReflectionServicer_to_server"


def _store(config: ServiceConfig) -> SessionStore:
    if not config.redis.url:
        raise ConfigError("redis.url: must be set for the Serve application (`dflash serve` sets it)")
    return open_store(config.redis.url, config.redis.ttl_s, config.redis.key_prefix, config.redis.socket_timeout_s)


def _setup(config: ServiceConfig, service: str) -> ServiceMetrics:
    from . import tracing

    tracing.setup_tracing(service, trace_dir=config.trace_dir)
    return ServiceMetrics(config.metrics)


class PublicAPI:
    """dflash.v1.Generation, grpc.health.v1.Health and reflection, as Serve's gRPC proxy calls them: the
    methods an application's ingress deployment has. A subclass sets `config`, `ingress` (the checks)
    and `health`, and defines `_open_stream` (where a checked request's chunks come from)."""

    config: ServiceConfig
    ingress: Ingress
    health: ServingCheck

    async def Generate(self, request: generate_pb2.GenerateRequest | MalformedMessage,
                       grpc_context: RayServegRPCContext) -> AsyncIterator[generate_pb2.GenerateChunk]:
        try:
            async for chunk in self.ingress.generate(request, _metadata(grpc_context), self._open_stream):
                yield chunk
        except Rejected as exc:
            _set_status(grpc_context, exc)
            raise

    async def ServerReflectionInfo(
        self, request_stream: AsyncIterator[reflection_pb2.ServerReflectionRequest | MalformedMessage],
        grpc_context: RayServegRPCContext,
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        try:
            async for reply in self.ingress.reflect(request_stream, _metadata(grpc_context)):
                yield reply
        except Rejected as exc:
            _set_status(grpc_context, exc)
            raise

    def _open_stream(self, verify: VerifyRequest,
                     carrier: dict[str, str]) -> AsyncIterator[generate_pb2.GenerateChunk | StreamError]:
        raise NotImplementedError

    async def Check(self, request: health_pb2.HealthCheckRequest | MalformedMessage,
                    grpc_context: RayServegRPCContext) -> health_pb2.HealthCheckResponse:
        from grpc_health.v1 import health_pb2

        try:
            check_decoded(request)
        except Rejected as exc:
            _set_status(grpc_context, exc)
            raise
        serving = await self.health.serving()  # Redis answers and a verifier replica holds a live lease
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Watch(self, request: health_pb2.HealthCheckRequest | MalformedMessage,
                    grpc_context: RayServegRPCContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        yield await self.Check(request, grpc_context)


@serve.deployment(name="ingress")
class IngressDeployment(PublicAPI):
    """The public APIs in a deployment of their own (`ingress_placement: separate`), relaying the
    verifier's stream. No torch here."""

    def __init__(self, verifier: DeploymentHandle, config: dict) -> None:
        self.config = ServiceConfig.for_replica(config)
        self.ingress = Ingress(self.config, _setup(self.config, "dflash-ingress"))
        self.verifier = verifier
        self.store = _store(self.config)
        self.consumer = Consumer.here()
        self.health = ServingCheck(self.store, self._ping_verifier)

    async def _open_stream(self, verify: VerifyRequest,
                           carrier: dict[str, str]) -> AsyncIterator[generate_pb2.GenerateChunk | StreamError]:
        # The verifier watches this replica (consumers.py): should it die, the stream stops there too.
        response = self.verifier.options(stream=True).stream.remote(verify, carrier, self.consumer)
        ended = False
        try:
            async for item in response:
                yield item
            ended = True
        except BackPressureError:
            yield StreamError("RESOURCE_EXHAUSTED", "server: too many requests in flight; retry with backoff")
        except RayActorError:
            yield StreamError("UNAVAILABLE", "verifier: the replica serving this request was lost; reconnect with "
                              "session_id and tokens_received to get the rest")
        finally:
            if not ended:  # the client went away, or an error: the verifier's stream stops now, not at its end
                response.cancel()

    async def _ping_verifier(self) -> bool:
        return await self.verifier.ready.remote()


@serve.deployment(name="verifier")
class VerifierDeployment(PublicAPI):
    """Owns the target and its batching engine: every Generate stream joins the same step loop. With
    `ingress_placement: verifier` it is the application's ingress too: the proxy calls `Generate`,
    checked here and streamed from the engine on this replica's event loop; otherwise the ingress
    deployment calls `stream`."""

    def __init__(self, config: dict, drafters: DeploymentHandle | None = None) -> None:
        from .parts import build_verifier_engine, set_threads
        from .verifier import Verifier

        cfg = self.config = ServiceConfig.for_replica(config)
        set_threads(cfg)
        metrics = _setup(cfg, "dflash-verifier")
        store = _store(cfg)
        if cfg.runs_engine_process:
            from .engine_process import EngineProcess
            from .step_telemetry import StepTelemetry

            engine = self.engine = EngineProcess(config, StepTelemetry(metrics))
        else:
            engine = self.engine = build_verifier_engine(cfg, store, metrics)
        engine.start_loop()  # one thread steps all streams; they are coroutines on this replica's loop
        self.verifier = Verifier(engine, store, cfg.model_name, metrics)
        self.ingress = Ingress(cfg, metrics)
        self.health = ServingCheck(store, self._ping_self)
        self.drafters = drafters  # holds the drafter deployment in the application graph
        self.consumers = ConsumerWatch()
        replica = ray.get_runtime_context().get_actor_id() or "verifier"
        self.lease = VerifierLease(store, replica, _running_loop()).start()

    def ready(self) -> bool:
        """Answers once the engine is up (health's ping where the store is in-process)."""
        return True

    def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine process died is replaced."""
        alive = getattr(self.engine, "alive", True)
        if not alive:
            self.lease.stop()  # no new stream is routed here meanwhile (health counts live leases)
            raise RuntimeError("the engine process is gone")

    def __del__(self) -> None:
        lease = getattr(self, "lease", None)
        if lease is not None:
            lease.stop()
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

    async def stream(self, verify: VerifyRequest, carrier: dict[str, str],
                     consumer: Consumer | None = None) -> AsyncIterator[generate_pb2.GenerateChunk | StreamError]:
        """One Generate's chunks; cancelled when `consumer` (the ingress replica reading it) dies."""
        with self.consumers.track(consumer):
            async for item in self.verifier.stream_async(verify, carrier):
                yield item

    def _open_stream(self, verify: VerifyRequest,
                     carrier: dict[str, str]) -> AsyncIterator[generate_pb2.GenerateChunk | StreamError]:
        return self.verifier.stream_async(verify, carrier)  # Serve cancels it when the proxy's call ends

    async def _ping_self(self) -> bool:
        return getattr(self.engine, "alive", True)


@serve.deployment(name="drafter")
class DrafterDeployment:
    """Owns a DFlash drafter (+ the target's embedding and LM head); serves the internal Drafter API."""

    def __init__(self, config: dict) -> None:
        from . import drafter_auth
        from .drafter_server import DrafterServer
        from .parts import build_draft_sessions, set_threads

        cfg = ServiceConfig.for_replica(config)
        set_threads(cfg)
        _setup(cfg, "dflash-drafter")
        store = _store(cfg)
        net = cfg.drafter_net
        self.server = DrafterServer(build_draft_sessions(cfg), store, net.host, net.port, workers=net.workers,
                                    token=net.token, credentials=drafter_auth.server_credentials(net)).start()
        drafter_auth.warn_if_open(net, self.server.address)

    def address(self) -> str:
        return self.server.address

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook for custom autoscaling metrics, called only when autoscaling_config is set: the
        Draft calls in flight (what the drafter policy in autoscaling.py scales on) and the hot sessions."""
        return self.server.load()

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


def build(args: dict | None = None) -> Application:
    """The application for a ServiceConfig tree (Serve's builder: `import_path: dflash.service.app:build`)."""
    config = ServiceConfig.for_replica(args or {})
    if config.mode == "disaggregated" and config.redis.url.startswith("memory://"):
        raise ConfigError("redis.url: the disaggregated mode needs Redis; the in-process store is one process only")
    # Replicas get the args alone and layer their own environment (secrets, pod address) on top,
    # so nothing from this process's environment is written into the Serve config.
    tree = ServiceConfig.from_dict(args or {}).to_dict()
    drafters = None
    if config.mode == "disaggregated":
        drafters = DrafterDeployment.options(**config.serve_options("drafter")).bind(tree)
    if config.ingress_placement == "verifier":
        verifier = VerifierDeployment
        if config.openai.enabled:  # plus the OpenAI API on Serve's HTTP proxy
            from .openai_api import OpenAIVerifierDeployment as verifier
        return verifier.options(**config.serve_options("verifier")).bind(tree, drafters)
    verifier = VerifierDeployment.options(**config.serve_options("verifier")).bind(tree, drafters)
    ingress = IngressDeployment
    if config.openai.enabled:  # the same ingress, plus the OpenAI API on Serve's HTTP proxy
        from .openai_api import OpenAIIngressDeployment as ingress
    return ingress.options(**config.serve_options("ingress")).bind(verifier, tree)


def grpc_options(config: ServiceConfig) -> gRPCOptions:
    """Serve's gRPC proxy options: the proxy's own reflection stays off (it would answer anyone); the
    ingress answers reflection instead, when config.reflection is on."""
    from ray.serve.config import gRPCOptions

    functions = [*SERVICERS, REFLECTION] if config.reflection else list(SERVICERS)
    return gRPCOptions(port=config.grpc_port, grpc_servicer_functions=functions, enable_reflection=False)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop a replica's constructor runs on (Serve's user-code loop, where its streams run)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _metadata(grpc_context: RayServegRPCContext) -> dict[str, str]:
    return {k: v for k, v in grpc_context.invocation_metadata() if isinstance(v, str)}


def _set_status(grpc_context: RayServegRPCContext, exc: Rejected) -> None:
    grpc_context.set_code(getattr(grpc.StatusCode, exc.code))
    grpc_context.set_details(exc.message)
