"""The public edge: checks a GenerateRequest (auth, size, fields), opens the request span, relays the
verifier's stream; answers server reflection behind the same token. Never imports torch: it runs on
CPU-only proxy nodes.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry import trace

from ..api.v1 import generate_pb2
from ..errors import InvalidRequestError
from ..params import SamplingParams
from ..scheduler import MAX_STREAM_INTERVAL_MS
from . import tracing
from .config import ServiceConfig
from .messages import MalformedMessage, StreamError, VerifyRequest, public_message
from .metrics import ServiceMetrics

# What a resuming client may send as session_id: ids this server issues are 32 hex digits.
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "block_size", "draft_confidence")
LIST_FIELDS = ("stop", "stop_token_ids")


class Rejected(Exception):
    """A request answered with a gRPC error: `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)  # both in args, so the exception survives pickling across Ray
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


OpenStream = Callable[[VerifyRequest, dict], AsyncIterator]

# How loud a client error is in the logs: one line, no traceback (a traceback is for our own faults).
# Overload and outages are WARNING: an operator acts on them; the rest is the client's to fix.
CLIENT_ERROR_LEVELS = {"RESOURCE_EXHAUSTED": logging.WARNING, "UNAVAILABLE": logging.WARNING}
SERVE_LOGGER = "ray.serve"


class ClientErrorLogFilter(logging.Filter):
    """Rewrites a log record whose exception is a Rejected into one line at INFO (WARNING for the codes in
    CLIENT_ERROR_LEVELS), without the traceback; other records pass untouched.

    Ray Serve logs every exception a deployment raises with its traceback at ERROR: the replica's
    "Request failed." (replica.py, _handle_errors_and_metrics) and the proxy's "Request failed with
    user-set gRPC status code" (grpc_util.py, get_grpc_response_status). A streaming deployment cannot
    end with a status without raising: the proxy copies the deployment's grpc_context onto the call
    only with each message it relays (proxy.py, send_request_to_replica), so a stream that returns
    after set_code ends OK. The Rejected is therefore still raised (the proxy answers with the code and
    details set on the context) and its records are rewritten here."""

    def filter(self, record: logging.LogRecord) -> bool:
        rejected = _rejected_in(record.exc_info[1] if record.exc_info else None)
        if rejected is not None:
            record.msg, record.args = "%s %s: %s", (record.getMessage(), rejected.code, rejected.message)
            record.levelno = CLIENT_ERROR_LEVELS.get(rejected.code, logging.INFO)
            record.levelname = logging.getLevelName(record.levelno)
            record.exc_info = record.exc_text = record.stack_info = None
        return True


def quiet_client_errors(logger_name: str = SERVE_LOGGER) -> None:
    """Install ClientErrorLogFilter on Ray Serve's logger (once per process)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, ClientErrorLogFilter) for f in logger.filters):
        logger.addFilter(ClientErrorLogFilter())


def _rejected_in(exc: BaseException | None) -> Rejected | None:
    """The Rejected `exc` is or wraps (Serve's gRPCStatusError.original_exception, RayTaskError.cause,
    a __cause__ or __context__), if any."""
    seen, pending = set(), [exc]
    while pending and len(seen) < 16:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, Rejected):
            return e
        seen.add(id(e))
        pending += [getattr(e, "original_exception", None), getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


# Installed where a Rejected can be logged: in the ingress replica, which imports this module, and in
# Ray's proxy, which imports it to unpickle the first Rejected it receives, before logging it.
quiet_client_errors()


class Ingress:
    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ServiceMetrics("none")
        self._reflection = None  # built at the first reflection call

    async def generate(self, request: generate_pb2.GenerateRequest, metadata: Mapping[str, str],
                       open_stream: OpenStream) -> AsyncIterator[generate_pb2.GenerateChunk]:
        """Relay the verifier's chunks; raises Rejected for every error the client should see."""
        name = f"text_completion {self.config.model_name}"
        with tracing.tracer().start_as_current_span(name, kind=trace.SpanKind.SERVER) as span:
            try:
                verify = self.admit(request, metadata)
                span.set_attributes(tracing.request_attributes(
                    self.config.model_name, verify.params or {}, verify.session_id))
                span.set_attribute("dflash.resumed", verify.resume)
                async for item in open_stream(verify, tracing.carrier()):
                    if isinstance(item, StreamError):
                        raise Rejected(item.code, public_message(item.message))
                    if item.HasField("final"):
                        f = item.final
                        span.set_attributes(tracing.final_attributes(
                            f.finish_reason, f.usage.prompt_tokens, f.usage.completion_tokens, f.tau, f.rounds))
                    yield item
            except Rejected as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, exc.message))
                span.set_attribute("rpc.grpc.status_code", exc.code)
                self.metrics.record_error(exc.code)
                raise

    def admit(self, request: generate_pb2.GenerateRequest, metadata: Mapping[str, str]) -> VerifyRequest:
        """Auth, size and field checks; a VerifyRequest for the verifier, or Rejected naming the field."""
        self._check_auth(metadata)
        check_decoded(request)
        limits = self.config.limits
        if len(request.prompt) > limits.max_prompt_chars:  # before anything that costs: the verifier tokenizes it
            raise Rejected("INVALID_ARGUMENT", f"prompt: {len(request.prompt)} characters exceeds "
                           f"limits.max_prompt_chars ({limits.max_prompt_chars}); shorten the prompt")
        if request.ByteSize() > limits.max_request_bytes:
            raise Rejected("INVALID_ARGUMENT", f"request: {request.ByteSize()} bytes exceeds the limit of "
                           f"{limits.max_request_bytes}; shorten the prompt")
        unknown = UnknownFieldSet(request)
        if len(unknown):
            raise Rejected("INVALID_ARGUMENT", f"field number {unknown[0].field_number}: unknown field "
                           "(this server speaks dflash.v1; check the client's proto)")
        if request.session_id:
            return self._resumption(request)
        if request.tokens_received:
            raise Rejected("INVALID_ARGUMENT", "tokens_received: only meaningful with session_id")
        if request.prompt and request.prompt_token_ids:
            raise Rejected("INVALID_ARGUMENT", "prompt: give prompt text or prompt_token_ids, not both")
        if not request.prompt and not request.prompt_token_ids:
            raise Rejected("INVALID_ARGUMENT", "prompt: is empty; give prompt text or prompt_token_ids")
        params = {f: getattr(request, f) for f in SAMPLING_FIELDS if request.HasField(f)}
        params.update({f: tuple(getattr(request, f)) for f in LIST_FIELDS if getattr(request, f)})
        params["ignore_eos"] = request.ignore_eos
        if len(params.get("stop", ())) > limits.max_stop_strings:
            raise Rejected("INVALID_ARGUMENT", f"stop: at most {limits.max_stop_strings} stop strings")
        if not 1 <= params.get("max_new_tokens", 1) <= limits.max_new_tokens:
            raise Rejected("INVALID_ARGUMENT", f"max_new_tokens: must be between 1 and {limits.max_new_tokens} "
                           f"(this server's limits.max_new_tokens), got {params['max_new_tokens']}")
        try:
            SamplingParams(**params)
        except InvalidRequestError as exc:
            raise Rejected("INVALID_ARGUMENT", str(exc)) from None
        return VerifyRequest(uuid.uuid4().hex, params, request.prompt, tuple(request.prompt_token_ids),
                             stream_interval_ms=_stream_interval(request))

    async def reflect(self, requests: AsyncIterable, metadata: Mapping[str, str]) -> AsyncIterator:
        """Server reflection (grpc.reflection.v1alpha) for dflash.v1.Generation and the health service:
        what `grpcurl list` and `describe` read. Rejected without the token when auth is on, and for a
        request that is not a ServerReflectionRequest."""
        from grpc_reflection.v1alpha import reflection

        if not self.config.reflection:  # still registered on a proxy started before it was turned off
            raise Rejected("UNIMPLEMENTED", "server reflection is turned off on this server (reflection: false)")
        self._check_auth(metadata)
        if self._reflection is None:
            from grpc_health.v1 import health_pb2  # noqa: F401 (its descriptors must be in the pool)

            self._reflection = reflection.aio.ReflectionServicer(
                ("dflash.v1.Generation", "grpc.health.v1.Health", reflection.SERVICE_NAME))

        async def decoded() -> AsyncIterator[Message]:
            async for request in requests:
                check_decoded(request)
                yield request

        async for reply in self._reflection.ServerReflectionInfo(decoded(), None):
            yield reply

    def _resumption(self, request: generate_pb2.GenerateRequest) -> VerifyRequest:
        if not SESSION_ID.fullmatch(request.session_id):
            raise Rejected("INVALID_ARGUMENT", f"session_id: must be 1 to 128 letters, digits, '.', '_', ':' or "
                           f"'-' (the id this server sent), got {len(request.session_id)} characters")
        for f in ("prompt", "prompt_token_ids", *SAMPLING_FIELDS, *LIST_FIELDS, "ignore_eos"):
            value = getattr(request, f)
            if (request.HasField(f) if f in SAMPLING_FIELDS else bool(value)):
                raise Rejected("INVALID_ARGUMENT", f"{f}: must be empty when resuming a session (the session holds it)")
        return VerifyRequest(request.session_id, tokens_received=request.tokens_received, resume=True,
                             stream_interval_ms=_stream_interval(request))

    def _check_auth(self, metadata: Mapping[str, str]) -> None:
        token = self.config.auth_token
        if not token:
            return
        sent = metadata.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            raise Rejected("UNAUTHENTICATED", "authorization: send metadata 'authorization: Bearer <token>'")


def _stream_interval(request: generate_pb2.GenerateRequest) -> int | None:
    """The request's own stream interval (delivery, not session state: a resume may set it too)."""
    if not request.HasField("stream_interval_ms"):
        return None
    if request.stream_interval_ms > MAX_STREAM_INTERVAL_MS:
        raise Rejected("INVALID_ARGUMENT", f"stream_interval_ms: must be at most {MAX_STREAM_INTERVAL_MS}, "
                       f"got {request.stream_interval_ms}")
    return request.stream_interval_ms


def check_decoded(request: Message | MalformedMessage) -> None:
    """Rejected (INVALID_ARGUMENT) for bytes that did not decode as the request (servicers.py)."""
    if isinstance(request, MalformedMessage):
        raise Rejected("INVALID_ARGUMENT", f"request: not a valid {request.message_type} ({request.reason}); "
                       "check the client's proto")
