"""The public port's edge cases, without Ray: undecodable request bytes, session ids, what error
messages may hold, and who may use server reflection.

A real grpc.aio server registers the very servicer functions Ray Serve's proxy imports (app.SERVICERS)
around the real Ingress; no verifier is needed, as every request here stops at the ingress (the same
paths through Ray's proxy are in test_service_ray.py).
"""

from __future__ import annotations

import asyncio
import pkgutil

import grpc
import pytest
from dflash.api.v1 import generate_pb2
from dflash.service.app import REFLECTION, SERVICERS
from dflash.service.config import ServiceConfig
from dflash.service.ingress import Ingress, Rejected
from dflash.service.messages import MAX_MESSAGE_CHARS, StreamError
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_fixtures import IngressServicer, loop  # noqa: F401

TOKEN = "s3cret-token"
pytestmark = pytest.mark.timeout(120)


class Edge(IngressServicer):
    """What IngressDeployment answers for Generate and reflection, on a plain grpc.aio server."""

    async def ServerReflectionInfo(self, request_iterator, context):  # noqa: N802
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        try:
            async for reply in self.ingress.reflect(request_iterator, metadata):
                yield reply
        except Rejected as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)


def serve(loop, auth_token: str, functions=(*SERVICERS, REFLECTION), reflection: bool = True):
    async def start():
        server = grpc.aio.server()
        servicer = Edge(Ingress(ServiceConfig(auth_token=auth_token, metrics="none", reflection=reflection)), None)
        for function in functions:
            if "Health" not in function:
                pkgutil.resolve_name(function)(servicer, server)  # as Serve's proxy imports them
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"

    return asyncio.run_coroutine_threadsafe(start(), loop).result(30)


@pytest.fixture(scope="module")
def edge(loop):
    server, address = serve(loop, TOKEN)
    yield address
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)


def raw_generate(address, data: bytes, token=TOKEN):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/dflash.v1.Generation/Generate")
        try:
            list(call(data, timeout=30, metadata=[("authorization", f"Bearer {token}")]))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


# --- undecodable bytes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [b"\xff\xfe\xfd random", b"\x08", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab"],
                         ids=["random", "truncated-varint", "length-past-the-end", "truncated-string"])
def test_bytes_that_are_no_request_are_invalid_argument(edge, data):
    code, details = raw_generate(edge, data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("request: not a valid dflash.v1.GenerateRequest")


def test_undecodable_bytes_need_the_token_first(edge):
    assert raw_generate(edge, b"\xff\xfe", token="wrong")[0] == grpc.StatusCode.UNAUTHENTICATED


def test_registered_as_generated_the_same_bytes_are_unknown(loop):
    """Why servicers.py exists: gRPC decodes before any handler runs."""
    server, address = serve(loop, TOKEN, ("dflash.api.v1.generate_pb2_grpc.add_GenerationServicer_to_server",))
    try:
        code, details = raw_generate(address, b"\xff\xfe\xfd random")
        assert code == grpc.StatusCode.UNKNOWN and "DecodeError" in details
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)


# --- session ids and what messages may echo -----------------------------------------------------------

@pytest.mark.parametrize("session_id", ["x" * 100_000, "x" * 129, "a b", "a/b", "ses\u00e9sion", "a\nb"])
def test_bad_session_ids_are_invalid_argument_without_an_echo(session_id):
    ingress = Ingress(ServiceConfig())
    with pytest.raises(Rejected) as err:
        ingress.admit(generate_pb2.GenerateRequest(session_id=session_id, tokens_received=1), {})
    assert err.value.code == "INVALID_ARGUMENT" and err.value.message.startswith("session_id: must be 1 to 128")
    assert session_id not in err.value.message and len(err.value.message) < 200


def test_issued_session_ids_pass():
    ingress = Ingress(ServiceConfig())
    for session_id in ("0123456789abcdef0123456789abcdef", "no-such-session", "s-1.2:3_x", "x" * 128):
        assert ingress.admit(generate_pb2.GenerateRequest(session_id=session_id), {}).resume


def test_messages_from_the_verifier_are_bounded_and_hold_no_credentials():
    ingress = Ingress(ServiceConfig())
    errors = [StreamError("UNAVAILABLE", "session store (Redis at redis://:pa55word@10.0.0.1:6379/0) is unreachable"),
              StreamError("INVALID_ARGUMENT", "stop: " + "y" * 100_000)]

    async def first_error(error):
        async def stream(verify, carrier):
            yield error

        with pytest.raises(Rejected) as err:
            async for _ in ingress.generate(generate_pb2.GenerateRequest(prompt="x"), {}, stream):
                pass
        return err.value

    unavailable, long = (asyncio.run(first_error(e)) for e in errors)
    assert unavailable.code == "UNAVAILABLE" and "pa55word" not in unavailable.message
    assert "redis://:***@10.0.0.1:6379/0" in unavailable.message
    assert long.code == "INVALID_ARGUMENT" and len(long.message) <= MAX_MESSAGE_CHARS


# --- server reflection follows auth --------------------------------------------------------------------

def list_services(address, token):
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=30, metadata=metadata)
        return {s.name for r in replies for s in r.list_services_response.service}


def test_reflection_needs_the_token_when_auth_is_on(edge):
    for token in ("", "wrong"):
        with pytest.raises(grpc.RpcError) as err:
            list_services(edge, token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert {"dflash.v1.Generation", "grpc.health.v1.Health"} <= list_services(edge, TOKEN)


def test_reflection_is_open_when_auth_is_off(loop):
    server, address = serve(loop, "")
    try:
        assert "dflash.v1.Generation" in list_services(address, "")
        with grpc.insecure_channel(address) as channel:  # and describes the API, as grpcurl asks
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            [reply] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="dflash.v1.Generation")]), timeout=30)
        assert reply.file_descriptor_response.file_descriptor_proto
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)


def test_reflection_turned_off_is_unimplemented_even_where_it_is_registered(loop):
    server, address = serve(loop, "", reflection=False)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list_services(address, "")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED and "reflection" in err.value.details()
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
