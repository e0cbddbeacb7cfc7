"""The verifier's side of the drafter transport: a `Drafter` that drafts on remote replicas over gRPC.

Each call asks, in one DraftBatch call per replica, the replica that rendezvous hashing picks for each
session, sending only the context committed since the session's previous call. The verifier keeps
each session's most recent `context_window` positions of target features in its own memory (never in
the session store): a session whose replica changed (a failure, a new replica) is sent that window
as a restart, and so is one the replica answers `missing_context` for (restarted, evicted). A replica
that fails is skipped for `retry_after_s` (doubled for each failure in a row) and the next one is asked;
a replica that answers later than a deadline derived from its recent answers (`_deadline_s`) counts as
failed for the round, whose sessions decode plainly and move to another replica next round. When no replica answers, the
round runs target-only (an empty draft): output stays exact, only slower, and the round's span says
so. Replicas come back by advertising themselves in the store again. Every call carries the
shared token, over mutual TLS when configured (drafter_auth.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import replace

import grpc
import torch
from opentelemetry import trace

from ..api.internal.v1 import drafter_pb2, drafter_pb2_grpc
from ..drafter.protocol import GREEDY, Draft, DraftRequest, DraftSampling
from ..errors import DFlashError
from . import codec, drafter_auth, tracing
from .config import DrafterNetConfig
from .metrics import ServiceMetrics
from .session_store import SessionStore

LIVE_REFRESH_S = 0.5  # how stale the list of live replicas may be (a dead one fails over at once anyway)
LATE_FACTOR = 8.0  # a replica answering this much slower than its median recent answer is late
LATENCY_SAMPLES = 32  # recent answers per replica that its deadline is derived from
MIN_SAMPLES = 4  # answers needed before a replica's deadline is shorter than timeout_s
log = logging.getLogger("dflash.service")


class ContextWindow:
    """A session's most recent target features, [rows, width], from position `start` on: the slices
    of each call kept as they came (no copy per round), the oldest dropped while the rest still covers
    `limit` positions (0: keep all)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.start = 0
        self._slices: list[torch.Tensor] = []
        self._rows = 0

    def extend(self, context: torch.Tensor, context_start: int) -> None:
        if context_start == 0 or context_start != self.start + self._rows:
            self.start, self._slices, self._rows = context_start, [], 0
        if context.shape[0]:
            self._slices.append(context)
            self._rows += context.shape[0]
        while self.limit and len(self._slices) > 1 and self._rows - self._slices[0].shape[0] >= self.limit:
            self._rows -= self._slices[0].shape[0]
            self.start += self._slices.pop(0).shape[0]

    def tensor(self) -> torch.Tensor:
        return torch.cat(self._slices) if len(self._slices) != 1 else self._slices[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._slices)


class RemoteDrafter:
    """Implements the `Drafter` protocol (see drafter/protocol.py) over the internal gRPC API."""

    separate_device = True  # drafts on the replicas' devices: the engine drafts beside verification

    def __init__(self, store: SessionStore, block_size: int, mask_token_id: int, target_layer_ids: tuple[int, ...],
                 net: DrafterNetConfig = DrafterNetConfig(), metrics: ServiceMetrics | None = None) -> None:
        self.store = store
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.target_layer_ids = tuple(target_layer_ids)
        self.net = net
        self.metrics = metrics or ServiceMetrics("none")
        self._channels: dict[str, tuple[grpc.Channel, drafter_pb2_grpc.DrafterStub]] = {}
        self._failed_until: dict[str, float] = {}
        self._windows: dict[str, ContextWindow] = {}
        self._holder: dict[str, str] = {}  # the replica holding each session's draft context
        self._live_list: list[str] = []
        self._live_at = -LIVE_REFRESH_S
        self._refused: set[str] = set()  # replicas that refused our token, logged once
        self._latencies: dict[str, deque[float]] = {}  # each replica's recent DraftBatch round trips (s)
        self._strikes: dict[str, int] = {}  # failures in a row: each doubles the time a replica is skipped
        self._releases: set[grpc.Future] = set()  # Release calls in flight
        self._lock = threading.Lock()

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """Drafts (see `Drafter.draft_batch`): one DraftBatch call per replica, all replicas at once; a
        session whose replica fails moves to its next candidate; Draft.none() when nobody answered. In a
        `dflash.drafts` span (a child of the step that asked, even when the call outlives it: drafts
        pipelined beside verification), the parent of the replicas' `dflash.draft` spans."""
        with tracing.tracer().start_as_current_span("dflash.drafts", kind=trace.SpanKind.CLIENT) as span:
            span.set_attributes({"dflash.drafts.sessions": len(requests),
                                 "dflash.drafts.session_ids": [r.session_id for r in requests]})
            return self._draft_batch(requests, span)

    def _draft_batch(self, requests: list[DraftRequest], span: trace.Span) -> list[Draft]:
        for r in requests:
            window = self._windows.setdefault(r.session_id, ContextWindow(self.net.context_window))
            window.extend(r.context.to("cpu"), r.context_start)  # host memory: the device's is for KV
        results: list[Draft | None] = [None] * len(requests)
        candidates = [self._candidates(r.session_id) for r in requests]
        restarts = [False] * len(requests)  # sent again with their window after a missing_context reply
        pending = list(range(len(requests)))
        while pending:
            groups: dict[str, list[int]] = {}
            for i in pending:
                if candidates[i]:
                    groups.setdefault(candidates[i][0], []).append(i)
            if not groups:
                break
            sent = time.monotonic()
            calls = {a: self._call_batch(a, [self._request_for(a, requests[i], restarts[i]) for i in idx])
                     for a, idx in groups.items()}
            pending = [i for i in pending if not candidates[i]]
            for address, idx in groups.items():
                deadline_s = self._deadline_s(address)
                try:
                    reply = calls[address].result(timeout=max(0.0, sent + deadline_s - time.monotonic()))
                    self._latencies.setdefault(address, deque(maxlen=LATENCY_SAMPLES)).append(time.monotonic() - sent)
                    self._strikes.pop(address, None)
                except grpc.FutureTimeoutError:  # late: its sessions decode plainly this round, elsewhere next
                    calls[address].cancel()
                    self._mark_failed(address)
                    log.warning("drafter replica %s did not answer within %.2f s; its %d sessions decode plainly "
                                "this round and move to another replica", address, deadline_s, len(idx))
                    span.add_event("drafter late", {"dflash.drafter.replica": address})
                    for i in idx:
                        if self._holder.get(requests[i].session_id) == address:
                            self._holder.pop(requests[i].session_id)
                    continue
                except grpc.RpcError as exc:
                    self._mark_failed(address)
                    self._log_refusal(address, exc)
                    span.add_event("drafter failed", {"dflash.drafter.replica": address, "grpc.code": str(exc.code())})
                    for i in idx:
                        candidates[i] = [a for a in candidates[i] if a != address]
                    pending.extend(idx)
                    continue
                for i, one in zip(idx, reply.replies):
                    sid = requests[i].session_id
                    if one.missing_context:
                        self._holder.pop(sid, None)
                        if restarts[i]:  # a restart cannot be missing its context: give up on this replica
                            candidates[i] = [a for a in candidates[i] if a != address]
                        restarts[i] = True
                        pending.append(i)
                        continue
                    self._holder[sid] = address
                    results[i] = Draft(torch.tensor(list(one.draft_token_ids), dtype=torch.long),
                                       torch.tensor(list(one.top_probs), dtype=torch.float32), one.replica)
        fallbacks = sum(r is None for r in results)
        span.set_attributes({"dflash.drafter.replicas": ",".join(sorted({d.replica for d in results if d})),
                             "dflash.drafter.fallback": fallbacks > 0})
        for _ in range(fallbacks):
            self.metrics.record_fallback()
        return [d if d is not None else Draft.none() for d in results]

    def draft(self, session_id: str, context: torch.Tensor, context_start: int, last_token: int, block_size: int,
              sampling: DraftSampling = GREEDY) -> torch.Tensor:
        """One session's proposals (empty when no replica answered: a target-only round)."""
        request = DraftRequest(session_id, context, context_start, last_token, block_size, sampling)
        return self.draft_batch([request])[0].tokens

    def release(self, session_id: str) -> None:
        """Forget the session here, and tell the replica holding it to drop its cache (best effort)."""
        address = self._holder.pop(session_id, None)
        self._windows.pop(session_id, None)
        if address is None:
            return
        if self._failed_until.get(address, 0.0) > time.monotonic():
            return  # a replica skipped as failed: it is not waited for (it evicts idle caches itself)
        # Not waited for: a hung replica must not hold the step that retires a session. Kept until done: a
        # grpc future that is garbage-collected cancels its call.
        call = self._stub(address).Release.future(drafter_pb2.ReleaseRequest(session_id=session_id),
                                                  timeout=self.net.timeout_s,
                                                  metadata=drafter_auth.call_metadata(self.net))
        self._releases.add(call)
        call.add_done_callback(self._releases.discard)

    def last_replica(self, session_id: str) -> str:
        return self._holder.get(session_id, "")

    def window(self, session_id: str) -> ContextWindow | None:
        """The context the verifier keeps for a session (what a restart sends)."""
        return self._windows.get(session_id)

    def window_bytes(self) -> int:
        """Memory held for all sessions' context windows."""
        return sum(w.nbytes for w in list(self._windows.values()))

    # -- helpers ----------------------------------------------------------------------------------

    def _request_for(self, address: str, request: DraftRequest, restart: bool) -> DraftRequest:
        """The request as it goes to `address`: only the new context where that replica holds the
        session, else the session's window as a restart."""
        if not restart and (request.context_start == 0 or self._holder.get(request.session_id) == address):
            return request
        window = self._windows[request.session_id]
        return replace(request, context=window.tensor(), context_start=window.start, restart=True)

    def _call_batch(self, address: str, requests: list[DraftRequest]) -> grpc.Future:
        """A DraftBatch call in flight (a grpc future)."""
        chunks = codec.draft_batch_chunks(requests, self.net.chunk_bytes)
        metadata = tracing.outgoing_metadata() + list(drafter_auth.call_metadata(self.net))
        return self._stub(address).DraftBatch.future(chunks, timeout=self.net.timeout_s, metadata=metadata)

    def _live(self) -> list[str]:
        """The replicas advertised in the store, read at most every LIVE_REFRESH_S (not once per step)
        while there are some; every call while there are none (a replica may be back any moment)."""
        now = time.monotonic()
        if not self._live_list or now - self._live_at >= LIVE_REFRESH_S:
            try:
                self._live_list = self.store.drafters()
            except DFlashError:
                self._live_list = list(self._channels)
            self._live_at = now
        return self._live_list

    def _candidates(self, session_id: str) -> list[str]:
        """Live replicas in rendezvous-hash order for this session, recently failed ones left out."""
        now = time.monotonic()
        ok = [a for a in self._live() if self._failed_until.get(a, 0.0) <= now]

        def score(address: str) -> bytes:
            return hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest()

        return sorted(ok, key=score, reverse=True)

    def _deadline_s(self, address: str) -> float:
        """How long a replica's DraftBatch is waited for: LATE_FACTOR times its median recent answer
        (the median: a cold first call or a restart's long context must not stretch it; all replicas'
        answers for one that has given too few, such as a new one), at least drafter_net.min_deadline_s,
        at most timeout_s (also while too few answers are known at all). A hung replica then holds a
        step for about that long, not for the whole timeout."""
        recent = self._latencies.get(address, ())
        if len(recent) < MIN_SAMPLES:
            recent = [t for times in list(self._latencies.values()) for t in times]
        if len(recent) < MIN_SAMPLES:
            return self.net.timeout_s
        return min(self.net.timeout_s, max(self.net.min_deadline_s, LATE_FACTOR * sorted(recent)[len(recent) // 2]))

    def _mark_failed(self, address: str) -> None:
        strikes = self._strikes[address] = self._strikes.get(address, 0) + 1
        self._failed_until[address] = time.monotonic() + self.net.retry_after_s * min(2 ** (strikes - 1), 16)
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel[0].close()

    def _log_refusal(self, address: str, exc: grpc.RpcError) -> None:
        """A replica that refuses the verifier is misconfigured, not down: say so (once per replica)."""
        if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT) \
                and address not in self._refused:
            self._refused.add(address)
            log.warning("drafter replica %s refused the verifier (%s: %s); check drafter_net.token on both",
                        address, exc.code().name, exc.details())

    def _stub(self, address: str) -> drafter_pb2_grpc.DrafterStub:
        with self._lock:
            if address not in self._channels:
                channel = open_channel(address, self.net)
                self._channels[address] = (channel, drafter_pb2_grpc.DrafterStub(channel))
            return self._channels[address][1]


def open_channel(address: str, net: DrafterNetConfig) -> grpc.Channel:
    """A channel to a replica: mutual TLS when drafter_net.tls_* is set, else plaintext."""
    options = [("grpc.max_send_message_length", 64 << 20), *drafter_auth.channel_options(net)]
    credentials = drafter_auth.channel_credentials(net)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def describe(address: str, timeout_s: float = 5.0,
             net: DrafterNetConfig = DrafterNetConfig()) -> drafter_pb2.DrafterInfo:
    with open_channel(address, net) as channel:
        return drafter_pb2_grpc.DrafterStub(channel).Describe(
            drafter_pb2.DescribeRequest(), timeout=timeout_s, metadata=drafter_auth.call_metadata(net))
