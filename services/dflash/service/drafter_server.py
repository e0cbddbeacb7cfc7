"""A drafter replica: the DFlash drafter (with the target's embedding and LM head) behind gRPC.

Hot sessions keep their draft cache in memory. A call that does not continue a cached session (a new
or restarted replica, a session moved here after a failure, an evicted cache) is answered with
`missing_context` for that session, and the verifier sends the session's recent context again as a
restart (drafter_client.py): no tensor ever goes through the session store.

Only the verifier may call it: the shared token and optional mutual TLS (drafter_auth.py). A request
that does not fit (bytes that are not the message, a headerless stream, a context of the wrong
shape, a token outside the vocabulary) is answered INVALID_ARGUMENT before the model sees it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent import futures

import grpc
from opentelemetry import trace

from ..api.internal.v1 import drafter_pb2, drafter_pb2_grpc
from ..drafter.local import LocalDrafter
from ..drafter.protocol import Draft, DraftRequest
from ..errors import DFlashError
from . import codec, tracing
from .autoscaling import HOT_SESSIONS, INFLIGHT_DRAFTS
from .config import DrafterNetConfig
from .drafter_auth import TokenCheck
from .messages import MalformedMessage, clip
from .servicers import add_lenient
from .session_store import SessionStore

MAX_SESSION_ID = 256  # the verifier's are "<session id>.<owner>", at most 128 + a counter
MAX_POSITION = 1 << 40


class MalformedDraft(DFlashError):
    """A Draft call that does not fit this replica; the message names the field."""


class DraftSessions:
    """The replica's drafting state: a LocalDrafter plus least-recently-used eviction."""

    def __init__(self, drafter: LocalDrafter, max_sessions: int = 256) -> None:
        self.drafter = drafter
        self.max_sessions = max_sessions
        self._recent: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # one forward at a time: the model and its cache are shared

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft | None]:
        """Drafts for many sessions in one forward (see `Drafter.draft_batch`); None for a session whose
        context this replica does not hold up to its context_start (the caller restarts it).
        MalformedDraft for a request that does not fit (see `check`)."""
        self.check(requests)
        with self._lock:
            ready = [r for r in requests if r.restart or r.context_start == 0
                     or self.drafter.session_length(r.session_id) == r.context_start]
            for r in ready:
                self._touch(r.session_id)
            drafts = dict(zip((r.session_id for r in ready), self.drafter.draft_batch(ready)))
        return [drafts.get(r.session_id) for r in requests]

    def check(self, requests: list[DraftRequest]) -> None:
        """MalformedDraft naming the first field of a request this replica cannot draft from."""
        width = self.drafter.model.fc.in_features
        vocab = self.drafter.embed_tokens.weight.shape[0]
        seen: set[str] = set()
        for r in requests:
            if not 0 < len(r.session_id) <= MAX_SESSION_ID or r.session_id in seen:
                raise MalformedDraft(f"session_id: 1 to {MAX_SESSION_ID} characters, once per call "
                                     f"(got {len(r.session_id)} characters)")
            seen.add(r.session_id)
            if r.context.dim() != 2 or r.context.shape[1] != width or not r.context.is_floating_point():
                raise MalformedDraft(f"context: must be floating point [rows, {width}], got "
                                     f"{str(r.context.dtype).removeprefix('torch.')}{list(r.context.shape)}")
            if not 1 < r.block_size <= self.drafter.block_size:
                raise MalformedDraft(f"block_size: {r.block_size} outside [2, {self.drafter.block_size}]")
            if not 0 <= r.last_token < vocab:
                raise MalformedDraft(f"last_token: {r.last_token} outside the vocabulary [0, {vocab})")
            if r.context_start + r.context.shape[0] >= MAX_POSITION:
                raise MalformedDraft(f"context_start: {r.context_start} is beyond any position")

    def release(self, session_id: str) -> None:
        with self._lock:
            self.drafter.release(session_id)
            self._recent.pop(session_id, None)

    @property
    def num_sessions(self) -> int:
        """Sessions with a hot draft cache; read without the lock, which a forward may hold for long."""
        return len(self._recent)

    def _touch(self, session_id: str) -> None:
        self._recent[session_id] = None
        self._recent.move_to_end(session_id)
        while len(self._recent) > self.max_sessions:
            old, _ = self._recent.popitem(last=False)
            self.drafter.release(old)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """The internal Drafter gRPC service of one replica."""

    def __init__(self, sessions: DraftSessions, replica: str) -> None:
        self.sessions = sessions
        self.replica = replica
        self.num_inflight = 0  # sessions of Draft calls being received, waiting for the model or drafting
        self._count_lock = threading.Lock()

    def DraftBatch(self, request_iterator: Iterator[drafter_pb2.DraftRequestChunk | MalformedMessage],
                   context: grpc.ServicerContext) -> drafter_pb2.DraftBatchReply:
        try:  # every check of what the caller sent, before any drafting
            requests = codec.join_draft_batch(_decoded(request_iterator))
            self.sessions.check(requests)
        except DFlashError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(str(exc)))
        with self._count_lock:
            self.num_inflight += len(requests)
        try:
            return self._draft(requests, context)
        finally:
            with self._count_lock:
                self.num_inflight -= len(requests)

    def _draft(self, requests: list[DraftRequest], context: grpc.ServicerContext) -> drafter_pb2.DraftBatchReply:
        parent = tracing.context_from(context.invocation_metadata())
        with tracing.tracer().start_as_current_span("dflash.draft", context=parent, kind=trace.SpanKind.SERVER) as span:
            span.set_attributes({"dflash.sessions": len(requests), "dflash.drafter.replica": self.replica,
                                 "dflash.context_rows": sum(r.context.shape[0] for r in requests)})
            if len(requests) == 1:
                span.set_attributes({"dflash.session_id": requests[0].session_id,
                                     "dflash.context_start": requests[0].context_start})
            t0 = time.perf_counter()
            try:
                drafts = self.sessions.draft_batch(requests)
            except DFlashError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, clip(str(exc)))
            span.set_attributes({"dflash.drafter.rebuilt": any(r.restart for r in requests),
                                 "dflash.drafter.missing": sum(d is None for d in drafts)})
            ms = (time.perf_counter() - t0) * 1000
            replies = [drafter_pb2.DraftReply(replica=self.replica, missing_context=True) if d is None else
                       drafter_pb2.DraftReply(draft_token_ids=d.tokens.tolist(), top_probs=d.probs.tolist(),
                                              replica=self.replica, rebuilt=r.restart, draft_ms=ms)
                       for r, d in zip(requests, drafts)]
            return drafter_pb2.DraftBatchReply(replies=replies, draft_ms=ms)

    def Release(self, request: drafter_pb2.ReleaseRequest | MalformedMessage,
                context: grpc.ServicerContext) -> drafter_pb2.ReleaseReply:
        if isinstance(request, MalformedMessage) or len(request.session_id) > MAX_SESSION_ID:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"session_id: not a ReleaseRequest with a session_id "
                          f"of at most {MAX_SESSION_ID} characters")
        self.sessions.release(request.session_id)
        return drafter_pb2.ReleaseReply()

    def Describe(self, request: drafter_pb2.DescribeRequest | MalformedMessage,
                 context: grpc.ServicerContext) -> drafter_pb2.DrafterInfo:
        if isinstance(request, MalformedMessage):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: not a DescribeRequest")
        d = self.sessions.drafter
        return drafter_pb2.DrafterInfo(
            replica=self.replica, block_size=d.block_size, mask_token_id=d.mask_token_id,
            target_layer_ids=list(d.target_layer_ids),
        )


class DrafterServer:
    """Serves a DraftSessions on host:port and advertises the address in the store while alive.

    token: callers must send `authorization: Bearer <token>` ("" checks nothing); credentials: TLS
    (drafter_auth.server_credentials), None for plaintext."""

    def __init__(self, sessions: DraftSessions, store: SessionStore, host: str = "127.0.0.1", port: int = 0,
                 advertise_every_s: float = 1.0, workers: int = DrafterNetConfig.workers, token: str = "",
                 credentials: grpc.ServerCredentials | None = None) -> None:
        self.store = store
        self.sessions = sessions
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers),
            interceptors=[TokenCheck(token)] if token else [],
            options=[("grpc.max_receive_message_length", 64 << 20)],
        )
        address = f"{host}:{port}"
        bound = (self.server.add_secure_port(address, credentials) if credentials is not None
                 else self.server.add_insecure_port(address))
        self.address = f"{host}:{bound}"
        self.servicer = DrafterServicer(sessions, self.address)
        add_lenient(drafter_pb2_grpc.add_DrafterServicer_to_server, self.servicer, self.server)
        self.advertise_every_s = advertise_every_s
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._advertise, daemon=True, name="drafter-advertise")

    def start(self) -> DrafterServer:
        self.server.start()
        self._heartbeat.start()
        return self

    def load(self) -> dict[str, float]:
        """This replica's autoscaling metrics (autoscaling.py): Draft calls in flight, hot sessions."""
        return {INFLIGHT_DRAFTS: float(self.servicer.num_inflight), HOT_SESSIONS: float(self.sessions.num_sessions)}

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.withdraw_drafter(self.address)
        except DFlashError:
            pass
        self.server.stop(grace=0)

    def _advertise(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.advertise_drafter(self.address, ttl_s=3 * self.advertise_every_s)
            except DFlashError:
                pass  # the store is down; the verifier cannot find us anyway
            self._stop.wait(self.advertise_every_s)


def _decoded(
    chunks: Iterable[drafter_pb2.DraftRequestChunk | MalformedMessage],
) -> Iterator[drafter_pb2.DraftRequestChunk]:
    """The stream's chunks; CodecError at the first one that did not decode (servicers.py)."""
    for chunk in chunks:
        if isinstance(chunk, MalformedMessage):
            raise codec.CodecError(f"the Draft stream holds a message that is not a {chunk.message_type}")
        yield chunk
