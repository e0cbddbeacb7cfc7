"""The verifier: owns the target, runs the engine's loop for one Generate, writes the session each round.

Rounds are committed to the store before they are streamed, so the store always holds at least what
the client has received: a client that reconnects with (session id, tokens received) is resumed by
re-prefilling prompt + those tokens with the stored seed, and position-seeded sampling regenerates
exactly the tokens it has not seen.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

from ..api.v1 import generate_pb2
from ..engine import SpeculativeEngine
from ..errors import DFlashError, InvalidRequestError
from ..generation import RoundOutput
from ..params import SamplingParams
from ..scheduler import QueueFullError
from . import tracing
from .messages import StreamError, VerifyRequest
from .metrics import ServiceMetrics
from .session_store import CANCELLED, FAILED, FINISHED, RUNNING, SessionRecord, SessionStore, StoreUnavailableError


class Verifier:
    """Streams GenerateChunk messages (or one StreamError) for a VerifyRequest."""

    def __init__(self, engine: SpeculativeEngine, store: SessionStore, model_name: str = "",
                 metrics: ServiceMetrics | None = None):
        self.engine = engine
        self.store = store
        self.model_name = model_name
        self.metrics = metrics or ServiceMetrics("none")

    def stream(self, request: VerifyRequest, carrier: dict | None = None,
               cancelled: threading.Event | None = None) -> Iterator[generate_pb2.GenerateChunk | StreamError]:
        cancelled = cancelled or threading.Event()
        token = tracing.otel_context.attach(tracing.context_from(carrier)) if carrier is not None else None
        try:
            yield from self._stream(request, cancelled)
        except InvalidRequestError as exc:
            yield StreamError("INVALID_ARGUMENT", str(exc))
        except StoreUnavailableError as exc:
            yield StreamError("UNAVAILABLE", str(exc))
        finally:
            if token is not None:
                tracing.otel_context.detach(token)

    def _stream(self, request: VerifyRequest, cancelled: threading.Event):
        record = self._resume(request) if request.resume else self._create(request)
        if isinstance(record, StreamError):
            yield record
            return
        committed = record.output_ids[: request.tokens_received]
        if record.status == FINISHED and request.tokens_received == len(record.output_ids):
            yield generate_pb2.GenerateChunk(session_id=record.session_id, final=_final_proto(record.final))
            return
        try:
            rounds = self.engine.generate(record.prompt_ids, record.sampling_params(), record.session_id,
                                          committed_ids=committed or None, seed=record.seed,
                                          trace_context=tracing.otel_context.get_current())
        except QueueFullError as exc:
            self._mark(record.session_id, FAILED)
            yield StreamError("RESOURCE_EXHAUSTED", str(exc))
            return
        status = FAILED
        try:
            for out in rounds:
                if out.token_ids or out.finish_reason or out.stats.index == 0:
                    self.store.commit(record.session_id, out.token_ids, out.stats.index)
                    yield self._chunk(record.session_id, out)
                if out.finish_reason is not None:
                    status = FINISHED
                    self._finish(record, out)
                    break
                if cancelled.is_set():
                    break
            if status != FINISHED:
                status = CANCELLED
        except GeneratorExit:  # the consumer went away between rounds
            status = CANCELLED
            raise
        finally:
            rounds.close()  # cancels the request in the engine unless it finished, freeing its caches
            if status != FINISHED:
                self._mark(record.session_id, status)

    def _create(self, request: VerifyRequest) -> SessionRecord:
        params = SamplingParams(**request.params)
        prompt_ids = list(request.prompt_ids) or self.engine.encode(request.prompt_text)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "encodes to no tokens; give a longer prompt")
        gen = self.engine.start(prompt_ids, params, request.session_id)  # validates prompt, block size, stops
        record = SessionRecord(request.session_id, gen.prompt_ids, dict(request.params), gen.seed, self.model_name)
        self.store.create(record)
        return record

    def _resume(self, request: VerifyRequest) -> SessionRecord | StreamError:
        record = self.store.get(request.session_id)
        if record is None:
            return StreamError("NOT_FOUND", f"session_id: no session {request.session_id!r} (unknown or expired)")
        if request.tokens_received > len(record.output_ids):
            return StreamError("INVALID_ARGUMENT", f"tokens_received: {request.tokens_received} exceeds the "
                               f"{len(record.output_ids)} tokens session {request.session_id!r} has committed")
        if record.status != FINISHED or request.tokens_received < len(record.output_ids):
            self.store.truncate_output(record.session_id, request.tokens_received)
            self.store.finish(record.session_id, RUNNING)
            if record.status == FINISHED:
                record.status = RUNNING
        return record

    def _chunk(self, session_id: str, out: RoundOutput) -> generate_pb2.GenerateChunk:
        s = out.stats
        chunk = generate_pb2.GenerateChunk(
            session_id=session_id, text=out.text, token_ids=out.token_ids,
            round=generate_pb2.RoundStats(
                index=s.index, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
                committed=s.committed, draft_ms=s.draft_ms, verify_ms=s.verify_ms, drafter=s.drafter,
            ),
        )
        if out.finish_reason is not None:
            chunk.final.CopyFrom(_final_proto(_final_dict(out)))
        return chunk

    def _finish(self, record: SessionRecord, out: RoundOutput) -> None:
        self.store.finish(record.session_id, FINISHED, _final_dict(out))
        self.metrics.record_request("finished", out.totals.tau, out.totals.decode_tokens_per_s)

    def _mark(self, session_id: str, status: str) -> None:
        self.metrics.record_request(status)
        try:
            self.store.finish(session_id, status)
        except DFlashError:
            pass  # the store is down: the session stays "running" and can still be resumed later


def new_session_id() -> str:
    return uuid.uuid4().hex


def _final_dict(out: RoundOutput) -> dict:
    t = out.totals
    return {"finish_reason": out.finish_reason, "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.generated_tokens, "tau": t.tau, "rounds": t.rounds,
            "decode_tokens_per_s": t.decode_tokens_per_s, "ttft_ms": t.ttft_s * 1000}


def _final_proto(final: dict) -> generate_pb2.Final:
    return generate_pb2.Final(
        finish_reason=final.get("finish_reason", ""),
        usage=generate_pb2.Usage(prompt_tokens=final.get("prompt_tokens", 0),
                                 completion_tokens=final.get("completion_tokens", 0)),
        tau=final.get("tau", 0.0), rounds=final.get("rounds", 0),
        decode_tokens_per_s=final.get("decode_tokens_per_s", 0.0), ttft_ms=final.get("ttft_ms", 0.0),
    )
