"""The verifier's side of the drafter transport: a `Drafter` that drafts on remote replicas over gRPC.

Every call first appends each session's context to its context log in the store (so any replica can
rebuild the session), then asks, in one DraftBatch call per replica, the replica that rendezvous
hashing picks for each session. A replica
that fails is skipped for `retry_after_s` and the next one is asked; the new one rebuilds from the log.
When no replica answers, the round runs target-only (an empty draft): output stays exact, only slower,
and the round's span says so. Replicas come back by advertising themselves in the store again.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque

import grpc
import torch
from opentelemetry import trace

from ..api.internal.v1 import drafter_pb2, drafter_pb2_grpc
from ..drafter.protocol import GREEDY, Draft, DraftRequest, DraftSampling
from ..errors import DFlashError
from . import codec, tracing
from .config import DrafterNetConfig
from .metrics import ServiceMetrics
from .session_store import SessionStore

LOG_SLICE_ROWS = 64  # context log entries hold at most this many positions, so the window trims finely


class RemoteDrafter:
    """Implements the `Drafter` protocol (see drafter/protocol.py) over the internal gRPC API."""

    def __init__(self, store: SessionStore, block_size: int, mask_token_id: int, target_layer_ids: tuple[int, ...],
                 net: DrafterNetConfig = DrafterNetConfig(), context_window: int = 0,
                 metrics: ServiceMetrics | None = None):
        self.store = store
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.target_layer_ids = tuple(target_layer_ids)
        self.net = net
        self.context_window = context_window
        self.metrics = metrics or ServiceMetrics("none")
        self._channels: dict[str, tuple[grpc.Channel, drafter_pb2_grpc.DrafterStub]] = {}
        self._failed_until: dict[str, float] = {}
        self._log_rows: dict[str, deque[int]] = {}  # rows per log entry, newest last
        self._last_replica: dict[str, str] = {}
        self._lock = threading.Lock()

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """Drafts (see `Drafter.draft_batch`): one DraftBatch call per replica, all replicas at once; a
        session whose replica fails moves to its next candidate; Draft.none() when nobody answered."""
        for r in requests:
            self._log_context(r.session_id, r.context, r.context_start)
        span = trace.get_current_span()
        results: list[Draft | None] = [None] * len(requests)
        candidates = [self._candidates(r.session_id) for r in requests]
        pending = list(range(len(requests)))
        while pending:
            groups: dict[str, list[int]] = {}
            for i in pending:
                if candidates[i]:
                    groups.setdefault(candidates[i][0], []).append(i)
            if not groups:
                break
            calls = {a: self._call_batch(a, [requests[i] for i in idx]) for a, idx in groups.items()}
            pending = [i for i in pending if not candidates[i]]
            for address, idx in groups.items():
                try:
                    reply = calls[address].result()
                except grpc.RpcError as exc:
                    self._mark_failed(address)
                    span.add_event("drafter failed", {"dflash.drafter.replica": address, "grpc.code": str(exc.code())})
                    for i in idx:
                        candidates[i] = [a for a in candidates[i] if a != address]
                    pending.extend(idx)
                    continue
                for i, one in zip(idx, reply.replies):
                    self._last_replica[requests[i].session_id] = address
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
        """Tell the replica that drafted last to drop the session's cache (best effort)."""
        address = self._last_replica.pop(session_id, None)
        with self._lock:
            self._log_rows.pop(session_id, None)
        if address is None:
            return
        try:
            self._stub(address).Release(drafter_pb2.ReleaseRequest(session_id=session_id), timeout=self.net.timeout_s)
        except grpc.RpcError:
            pass

    def last_replica(self, session_id: str) -> str:
        return self._last_replica.get(session_id, "")

    # -- helpers ----------------------------------------------------------------------------------

    def _call_batch(self, address: str, requests: list[DraftRequest]):
        """A DraftBatch call in flight (a grpc future)."""
        chunks = codec.draft_batch_chunks(requests, self.net.chunk_bytes)
        return self._stub(address).DraftBatch.future(chunks, timeout=self.net.timeout_s,
                                                     metadata=tracing.outgoing_metadata())

    def _log_context(self, session_id: str, context: torch.Tensor, context_start: int) -> None:
        """Append to the context log; a call from position 0 (new or re-prefilled session) restarts it."""
        with self._lock:
            rows = self._log_rows.setdefault(session_id, deque())
            if context_start == 0:
                rows.clear()
        for offset in range(0, max(context.shape[0], 1), LOG_SLICE_ROWS):
            piece = context[offset : offset + LOG_SLICE_ROWS]
            with self._lock:
                rows.append(piece.shape[0])
                keep = self._entries_to_keep(rows)
            self.store.append_context(
                session_id, codec.pack_log_entry(context_start + offset, piece),
                reset=context_start == 0 and offset == 0, keep_entries=keep,
            )

    def _entries_to_keep(self, rows: deque[int]) -> int:
        """The fewest newest entries covering the window (0: keep all)."""
        if self.context_window <= 0:
            return 0
        total = 0
        for i, n in enumerate(reversed(rows), start=1):
            total += n
            if total >= self.context_window:
                while len(rows) > i:
                    rows.popleft()
                return i
        return 0

    def _candidates(self, session_id: str) -> list[str]:
        """Live replicas in rendezvous-hash order for this session, recently failed ones left out."""
        try:
            live = self.store.drafters()
        except DFlashError:
            live = list(self._channels)
        now = time.monotonic()
        ok = [a for a in live if self._failed_until.get(a, 0.0) <= now]

        def score(address: str) -> bytes:
            return hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest()

        return sorted(ok, key=score, reverse=True)

    def _mark_failed(self, address: str) -> None:
        self._failed_until[address] = time.monotonic() + self.net.retry_after_s
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel[0].close()

    def _stub(self, address: str) -> drafter_pb2_grpc.DrafterStub:
        with self._lock:
            if address not in self._channels:
                channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
                self._channels[address] = (channel, drafter_pb2_grpc.DrafterStub(channel))
            return self._channels[address][1]


def describe(address: str, timeout_s: float = 5.0) -> drafter_pb2.DrafterInfo:
    with grpc.insecure_channel(address) as channel:
        return drafter_pb2_grpc.DrafterStub(channel).Describe(drafter_pb2.DescribeRequest(), timeout=timeout_s)
