"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, whole or streamed
as server-sent events (sse-starlette frames them).

The data path is the gRPC one: each request becomes a dflash GenerateRequest (openai_models.py) and
goes through the same `Ingress.generate` (bearer token, limits, field checks, the request span, error
metrics) and the same verifier stream. `OpenAIServer` holds no Ray: the Serve deployment at the bottom
adds these routes to the gRPC ingress deployment, so one replica (and one Serve application, which
keeps gRPC clients free of an `application` metadata key) answers both proxies.

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`, with an HTTP status from
the gRPC code the same request would get; the message names the request field. The token is checked
before the body is read, so a caller without it learns nothing about the API.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Mapping

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from ..api.v1 import generate_pb2
from .app import IngressDeployment, VerifierDeployment
from .ingress import Ingress, OpenStream, Rejected
from .openai_chat import ChatTemplate, NoChatTemplate
from .openai_models import ChatCompletionRequest, CompletionRequest, ResponseShape, unsupported_field

# gRPC code -> (HTTP status, OpenAI error type)
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNIMPLEMENTED": (501, "not_implemented_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
# dflash field names in the ingress's messages -> the OpenAI request's
RENAMED = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}
FIELD_PATH = re.compile(r"[A-Za-z_]\w*(\[\d+\]|\.[A-Za-z_]\w*)*")  # stop, messages[0].role, stream_options.x
NOT_FIELDS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union-member tags in an error's loc


def error_body(exc: Rejected, chat: bool = False) -> tuple[int, dict]:
    """(HTTP status, OpenAI error JSON) for a Rejected; `param` is the field its message starts with."""
    status, kind = STATUS.get(exc.code, (500, "server_error"))
    field, sep, rest = exc.message.partition(":")
    param = None
    if sep and FIELD_PATH.fullmatch(field) and field != "request":
        param = RENAMED.get(field, field)
        if chat and param == "prompt":
            param = "messages"
        message = param + sep + rest
    else:
        message = exc.message
    code = "model_not_found" if param == "model" and status == 404 else exc.code.lower()
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: Rejected, chat: bool = False) -> JSONResponse:
    status, body = error_body(exc, chat)
    return JSONResponse(body, status_code=status)


class OpenAIServer:
    """The three endpoints over an Ingress and a verifier stream (`open_stream`, as the gRPC ingress's)."""

    def __init__(self, ingress: Ingress, open_stream: OpenStream, chat: ChatTemplate) -> None:
        self.ingress = ingress
        self.open_stream = open_stream
        self.chat = chat
        self.created = int(time.time())

    @property
    def model(self) -> str:
        return self.ingress.config.model_name

    async def models(self, headers: Mapping[str, str]) -> Response:
        try:
            self._check_auth(headers)
        except Rejected as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.created, "owned_by": "dflash"}]})

    async def respond(self, kind: type[CompletionRequest | ChatCompletionRequest], body: bytes,
                      headers: Mapping[str, str]) -> Response:
        """A completion (kind CompletionRequest) or chat completion, JSON or an event stream."""
        chat = kind is ChatCompletionRequest
        try:
            request, proto = self._translate(kind, body, headers)
        except Rejected as exc:
            self.ingress.metrics.record_error(exc.code)
            return error_response(exc, chat)
        chunks = self.ingress.generate(proto, headers, self.open_stream)
        try:
            first = await anext(chunks)  # admission errors are answered before any byte of the response
        except Rejected as exc:
            return error_response(exc, chat)
        shape = ResponseShape(chat, self.model, first.session_id)
        if request.stream:
            return EventSourceResponse(_events(shape, first, chunks, request.include_usage, chat))
        text, final = [], None
        try:
            async for chunk in _chain(first, chunks):
                text.append(chunk.text)
                final = chunk.final if chunk.HasField("final") else final
        except Rejected as exc:
            return error_response(exc, chat)
        return JSONResponse(shape.whole("".join(text), final))

    def _translate(self, kind: type[CompletionRequest | ChatCompletionRequest], body: bytes,
                   headers: Mapping[str, str]) -> tuple[CompletionRequest | ChatCompletionRequest,
                                                        generate_pb2.GenerateRequest]:
        """The checks only HTTP needs (the rest are the ingress's); Rejected naming the field."""
        self._check_auth(headers)
        limit = self.ingress.config.limits.max_request_bytes
        if len(body) > limit:
            raise Rejected("INVALID_ARGUMENT", f"request: {len(body)} bytes exceeds the limit of {limit}")
        try:
            request = kind.model_validate_json(body)
        except pydantic.ValidationError as exc:
            raise Rejected("INVALID_ARGUMENT", _validation_message(exc)) from None
        if request.model != self.model:
            raise Rejected("NOT_FOUND", f"model: '{request.model[:128]}' is not served here; this server "
                           f"serves '{self.model}' (GET /v1/models)")
        refused = unsupported_field(request)
        if refused:
            raise Rejected("INVALID_ARGUMENT", f"{refused[0]}: {refused[1]}")
        if isinstance(request, CompletionRequest):
            return request, request.generate_request()
        try:
            ids = self.chat.prompt_ids([m.template_input() for m in request.messages])
        except NoChatTemplate as exc:
            raise Rejected("INVALID_ARGUMENT", f"messages: {exc}") from None
        return request, request.generate_request(ids)

    def _check_auth(self, headers: Mapping[str, str]) -> None:
        # The gRPC ingress's own check: HTTP's `Authorization: Bearer <token>` is its metadata.
        self.ingress._check_auth(headers)


async def _chain(first: generate_pb2.GenerateChunk,
                 rest: AsyncIterator[generate_pb2.GenerateChunk]) -> AsyncIterator[generate_pb2.GenerateChunk]:
    yield first
    async for chunk in rest:
        yield chunk


async def _events(shape: ResponseShape, first: generate_pb2.GenerateChunk,
                  rest: AsyncIterator[generate_pb2.GenerateChunk], include_usage: bool,
                  chat: bool) -> AsyncIterator[dict]:
    """OpenAI's stream: a chunk per verifier chunk with text (the first always, carrying the chat
    role), finish_reason on the last, then the usage chunk when asked for, then [DONE]. An error after
    the stream began is sent as an event holding OpenAI's error JSON, and ends it."""
    sent = 0
    try:
        async for chunk in _chain(first, rest):
            final = chunk.final if chunk.HasField("final") else None
            if chunk.text or final is not None or sent == 0:
                yield {"data": json.dumps(shape.chunk(chunk.text, final, sent == 0, include_usage))}
                sent += 1
            if final is not None and include_usage:
                yield {"data": json.dumps(shape.usage_chunk(final))}
    except Rejected as exc:
        yield {"data": json.dumps(error_body(exc, chat)[1])}
        return
    yield {"data": "[DONE]"}


def _validation_message(exc: pydantic.ValidationError) -> str:
    """pydantic's first error as `field: problem`, the field as the request spells it."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return f"request: the body is not valid JSON ({first['ctx'].get('error', first['msg'])})"
    if first["type"] == "model_type" or not first["loc"]:
        return "request: the body must be a JSON object"
    where = ""
    for part in first["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif part.isidentifier() and part not in NOT_FIELDS:
            where += f".{part}" if where else part
        else:
            break
    if first["type"] == "extra_forbidden":
        return f"{where}: not supported by this server (not an OpenAI field it knows; see docs/service.md)"
    if first["type"] == "missing":
        return f"{where}: is required"
    return f"{where}: {first['msg'][:200]}"


def build_app(server: OpenAIServer) -> FastAPI:
    """The FastAPI application of `server` (Serve's ASGI app on a replica; uvicorn's in tests)."""
    app = FastAPI(title="dflash OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await server.models(request.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.respond(CompletionRequest, await request.body(), request.headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.respond(ChatCompletionRequest, await request.body(), request.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:  # unknown path, wrong method
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                                       "type": "invalid_request_error", "param": None, "code": None}},
                            status_code=exc.status_code)

    return app


@serve.deployment(name="ingress")
@serve.ingress()
class OpenAIIngressDeployment(IngressDeployment.func_or_class):
    """The gRPC ingress (dflash.v1.Generation, health, reflection: inherited) plus the OpenAI API on
    Serve's HTTP proxy, in the same replica, with the same Ingress and verifier handle."""

    def __init__(self, verifier: DeploymentHandle, config: dict) -> None:
        super().__init__(verifier, config)
        self.openai = OpenAIServer(self.ingress, self._open_stream, ChatTemplate.load(self.config.model.target))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.openai)


@serve.deployment(name="verifier")
@serve.ingress()
class OpenAIVerifierDeployment(VerifierDeployment.func_or_class):
    """The verifier as the application's ingress (`ingress_placement: verifier`), plus the OpenAI API:
    its streams come from this replica's engine, as its gRPC ones do."""

    def __init__(self, config: dict, drafters: DeploymentHandle | None = None) -> None:
        super().__init__(config, drafters)
        self.openai = OpenAIServer(self.ingress, self._open_stream, ChatTemplate.load(self.config.model.target))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.openai)
