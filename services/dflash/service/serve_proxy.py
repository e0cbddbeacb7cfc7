"""What clients see through Ray Serve's gRPC proxy when a replica dies, hangs or loses its client.

Serve's proxy imports this server's servicers (servicers.py) by path, in its own process (under
`dflash serve` and on a cluster alike); each `add_*_to_server` calls `install(server)` first, which
wraps the handlers the proxy builds for every method (`gRPCGenericServer.service_handler_factory`,
ray/serve/_private/grpc_util.py and proxy.py, read against Ray 2.60). Three changes, all to what the
proxy does after Serve's own code has run:

- **A lost replica is UNAVAILABLE.** The proxy answers a call whose ingress replica died with
  INTERNAL and the RayActorError's text (actor id, pid, IP address). It becomes UNAVAILABLE with the
  resume hint; any other INTERNAL becomes INTERNAL without the exception's text (the proxy's log
  keeps it), so no Ray internals or tracebacks reach a client.
- **A client's cancel always reaches the ingress.** The proxy cancels the replica's call only when the
  cancellation lands while it waits for the replica (ProxyResponseGenerator.__anext__). A cancel that
  lands while a message is being written to the client closes the proxy's generator instead
  (GeneratorExit) and leaves the ingress, the verifier and the engine generating to the end (about 1
  call in 8 under load). Here Serve's relay runs in a task of its own that only ever waits inside
  Serve, fed to the client through an unbounded queue, and a call that ends early cancels that task.
- **Health answers in time.** With the ingress replica gone (killed, being replaced), the proxy holds
  a Check until a replica exists (seconds). Check is answered NOT_SERVING once HEALTH_DEADLINE_S (or
  the caller's deadline, less a margin) has passed without the ingress's answer.

A Ray whose proxy has no `service_handler_factory` gets none of this, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

log = logging.getLogger("dflash.service")

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_DEADLINE_S = 2.0
DEADLINE_MARGIN_S = 0.2  # answered this long before the caller's deadline, so the answer arrives
LOST_REPLICA = ("server: the replica serving this request was lost; retry, and a stream that had begun "
                "resumes with session_id and tokens_received to get the rest")
INTERNAL_FAULT = "server: internal error (a fault of the server's; its log has the details)"
_END = object()


def install(server: object) -> None:
    """Wrap the handlers Serve's gRPC proxy builds on `server` (its gRPCGenericServer); nothing for any
    other server (the drafter's, a test's)."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        if type(server).__module__.startswith("ray."):
            log.warning("Ray Serve's gRPC proxy has no service_handler_factory (a Ray version this server was "
                        "not written against): lost replicas, cancels and health keep Ray's own behaviour")
        return
    if getattr(factory, "dflash_wrapped", False):
        return

    def service_handler_factory(service_method: str, streaming_type: object) -> Callable:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        kind = getattr(streaming_type, "name", "")
        if kind == "UNARY_STREAM":
            return relay_stream(handler)
        if kind == "UNARY_UNARY":
            return bounded_health(handler) if service_method == HEALTH_CHECK else public_unary(handler)
        return handler

    service_handler_factory.dflash_wrapped = True
    server.service_handler_factory = service_handler_factory


def relay_stream(handler: Callable) -> Callable:
    """A server-streaming handler of Serve's, run so that a call ending early always cancels it inside
    its wait for the replica (which cancels the replica's call), and with public statuses.

    Written with `context.write`, not as a generator: every wait of the call, the writes to the client
    included, is then in this coroutine, so gRPC's cancellation lands here and the handler outlives
    Serve's relay."""

    async def unary_stream(request: object, context: grpc.aio.ServicerContext) -> None:
        queue: asyncio.Queue = asyncio.Queue()  # unbounded: the relay never waits outside Serve's own await
        call = CallContext(context)

        async def relay() -> None:
            try:
                async for message in handler(request, call):
                    queue.put_nowait(message)
            finally:
                queue.put_nowait(_END)

        task = asyncio.ensure_future(relay())
        try:
            while (message := await queue.get()) is not _END:
                await context.write(message)
            await task
            make_public(context)
        finally:
            if not task.done():  # the client went away (or the call was cancelled) mid-stream
                task.cancel()
            await outlive(task)

    return unary_stream


class CallContext:
    """A call's gRPC context as Serve's relay sees it: the peer read once, while the call is alive.

    Serve's relay asks for the peer only for its access log, at its very end; after a cancel that end
    comes when gRPC has already released the call, and `peer()` then reads freed memory (measured: the
    proxy died of SIGSEGV in grpc_call_get_peer, every client of the proxy getting UNAVAILABLE "Socket
    closed"). Everything else is the context's own."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._peer = context.peer()

    def peer(self) -> str:
        return self._peer

    def __getattr__(self, name: str) -> object:
        return getattr(self._context, name)


async def outlive(task: asyncio.Future) -> None:
    """Wait until `task` is over, whatever cancels the caller meanwhile."""
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            continue
    if not task.cancelled():
        task.exception()  # retrieved: a relay that failed after its call ended is not logged as unhandled


def public_unary(handler: Callable) -> Callable:
    async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> bytes:
        reply = await handler(request, context)
        make_public(context)
        return reply

    return unary_unary


def bounded_health(handler: Callable) -> Callable:
    """Check answered by the ingress when it answers in time, else NOT_SERVING."""

    async def unary_unary(request: object, context: grpc.aio.ServicerContext) -> bytes:
        from grpc_health.v1 import health_pb2

        remaining = context.time_remaining()
        wait_s = HEALTH_DEADLINE_S if remaining is None else max(0.05, min(HEALTH_DEADLINE_S,
                                                                          remaining - DEADLINE_MARGIN_S))
        task = asyncio.ensure_future(handler(request, CallContext(context)))
        done, _ = await asyncio.wait({task}, timeout=wait_s)
        if task in done:
            reply = task.result()
            make_public(context)
            return reply
        task.cancel()  # Serve's relay answers its own cancellation with a status: overwrite it
        await outlive(task)
        context.set_code(grpc.StatusCode.OK)
        context.set_details("")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING).SerializeToString()

    return unary_unary


def make_public(context: grpc.aio.ServicerContext) -> None:
    """Rewrite the status Serve set on the call when it is an INTERNAL carrying an exception's text."""
    if context.code() != grpc.StatusCode.INTERNAL:
        return
    details = context.details() or ""
    details = details.decode(errors="replace") if isinstance(details, bytes) else details
    if lost_replica(details):
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(LOST_REPLICA)
    else:
        context.set_details(INTERNAL_FAULT)


def lost_replica(details: str) -> bool:
    """Whether INTERNAL details are the text of a RayActorError (ray/exceptions.py: ActorDiedError and
    ActorUnavailableError say "The actor ..." and name the replica's class, ServeReplica:<app>:<name>)."""
    return details.startswith("The actor ") or "ServeReplica:" in details.split("\n", 1)[0]
