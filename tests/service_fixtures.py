"""Fixtures for the service tests: a real redis-server (AOF on, in a temp dir) and tiny model directories."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from dflash.api.v1 import generate_pb2_grpc
from dflash.drafter.checkpoint import save_drafter
from dflash.service.ingress import Rejected
from dflash.service.redis_process import RedisProcess, redis_server_path
from tiny import char_tokenizer, tiny_drafter, tiny_target

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def loop():
    """An asyncio event loop running in its own thread (for aio gRPC servers in sync tests)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed (scripts/install.sh installs it)")
    server = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """A clean database on the shared server."""
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server.url


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """(target dir with a char tokenizer, drafter dir): tiny random Qwen3 target and DFlash drafter."""
    root = tmp_path_factory.mktemp("models")
    target = tiny_target("qwen3", max_positions=256)
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    save_drafter(tiny_drafter(target, block_size=BLOCK_SIZE), root / "drafter")
    return root / "target", root / "drafter"


class IngressServicer(generate_pb2_grpc.GenerationServicer):
    """Generate as IngressDeployment serves it (the real Ingress over a real Verifier), minus Ray, whose
    proxy costs tens of seconds to start. Subclasses see each call's metadata in `arrived` and may wrap
    the verifier's stream in `_open_stream`."""

    def __init__(self, ingress, verifier):
        self.ingress, self.verifier = ingress, verifier

    async def Generate(self, request, context):
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.arrived(metadata, context)
        try:
            async for chunk in self.ingress.generate(request, metadata, self._open_stream):
                yield chunk
        except Rejected as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)

    def arrived(self, metadata: dict, context) -> None:
        """Called as each Generate call arrives."""

    def _open_stream(self, verify, carrier):
        return self.verifier.stream_async(verify, carrier)


def install_span_exporter(exporter) -> None:
    """Send every finished span to `exporter` too. OpenTelemetry's global tracer provider can be set
    once per process, so modules add their exporters to the one SDK provider the first of them set."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))


def wait_until(predicate, timeout_s: float = 10.0, what: str = "the condition", interval_s: float = 0.02):
    """Poll `predicate` until it is true (returns its value) or fail after `timeout_s`, naming `what`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def assert_lost_stream(error: grpc.RpcError, ingress_proxy: str) -> None:
    """What a client sees when the replica streaming to it is lost, by the proxy in front (docs/service.md):
    Serve's Python proxy ("ray") answers UNAVAILABLE with the resume hint and no Ray internals; HAProxy
    resets the stream (RST_STREAM: CANCELLED), and the client resumes with the session id its chunks carry."""
    details = error.details() or ""
    if ingress_proxy == "haproxy":
        assert error.code() == grpc.StatusCode.CANCELLED, (error.code(), details)
    else:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), details)
        assert "session_id" in details and "tokens_received" in details, details
    assert not any(w in details for w in ("actor", "ServeReplica", "pid", "ip:", "Traceback")), details
