"""The verifier: owns the target's engine; turns a VerifyRequest into a stream of GenerateChunks.

The engine writes each step's rounds to the session store (one write for all sessions) before they
are streamed, so the store always holds at least what the client has received: a client that
reconnects with (session id, tokens received) is resumed by re-prefilling prompt + those tokens with
the stored seed, and position-seeded sampling regenerates exactly the tokens it has not seen. A resume
takes the session over (a new owner token): a stream still running for it elsewhere ends with ABORTED
at its next step, without writing anything more.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ..api.v1 import generate_pb2
from ..engine import SpeculativeEngine
from ..errors import DFlashError, InvalidRequestError
from ..generation import RoundOutput
from ..journal import SessionFencedError
from ..params import SamplingParams
from ..scheduler import QueueFullError
from . import tracing
from .messages import StreamError, VerifyRequest
from .metrics import ServiceMetrics
from .session_store import (
    CANCELLED,
    FAILED,
    FINISHED,
    SessionNotFoundError,
    SessionRecord,
    SessionStore,
    StoreUnavailableError,
)


class Verifier:
    """Streams GenerateChunk messages (or one StreamError) for a VerifyRequest."""

    def __init__(self, engine: SpeculativeEngine, store: SessionStore, model_name: str = "",
                 metrics: ServiceMetrics | None = None) -> None:
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
        except SessionNotFoundError as exc:
            yield StreamError("NOT_FOUND", str(exc))
        except SessionFencedError as exc:
            yield StreamError("ABORTED", str(exc))
        except StoreUnavailableError as exc:
            yield StreamError("UNAVAILABLE", str(exc))
        finally:
            if token is not None:
                tracing.otel_context.detach(token)

    def _stream(self, request: VerifyRequest,
                cancelled: threading.Event) -> Iterator[generate_pb2.GenerateChunk | StreamError]:
        record = self.store.take_over(request.session_id, request.tokens_received) if request.resume \
            else self._create(request)
        if record.status == FINISHED:  # a resume of a finished session whose client has every token
            yield generate_pb2.GenerateChunk(session_id=record.session_id, final=_final_proto(record.final))
            return
        # request_id keys the engine's caches: one per owner, as a resume may start before the stream it
        # replaces has noticed; session_id is what the engine's journal commits to.
        gen = self.engine.start(record.prompt_ids, record.sampling_params(), f"{record.session_id}.{record.owner}",
                                committed_ids=record.output_ids or None, seed=record.seed)
        gen.session_id, gen.owner = record.session_id, record.owner
        gen.trace_context = tracing.otel_context.get_current()
        try:
            self.engine.submit(gen)
        except QueueFullError as exc:
            self._mark(record, FAILED)
            yield StreamError("RESOURCE_EXHAUSTED", str(exc))
            return
        batches = self.engine.stream_batches(gen)
        status = FAILED
        try:
            for rounds in batches:
                chunk = self._chunk(record.session_id, rounds)
                if chunk is not None:
                    yield chunk
                last = rounds[-1]
                if last.finish_reason is not None:
                    status = FINISHED
                    self._finish(record, last)
                    break
                if cancelled.is_set():
                    break
            if status != FINISHED:
                status = CANCELLED
        except GeneratorExit:  # the consumer went away between rounds
            status = CANCELLED
            raise
        except SessionFencedError:
            status = None  # the session is someone else's now: leave its status alone
            raise
        finally:
            batches.close()  # cancels the request in the engine unless it finished, freeing its caches
            if status not in (FINISHED, None):
                self._mark(record, status)

    def _create(self, request: VerifyRequest) -> SessionRecord:
        params = SamplingParams(**request.params)
        prompt_ids = list(request.prompt_ids) or self.engine.encode(request.prompt_text)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "encodes to no tokens; give a longer prompt")
        gen = self.engine.start(prompt_ids, params, request.session_id)  # validates prompt, block size, stops
        record = SessionRecord(request.session_id, gen.prompt_ids, dict(request.params), gen.seed, self.model_name)
        self.store.create(record)
        return record

    def _chunk(self, session_id: str, rounds: list[RoundOutput]) -> generate_pb2.GenerateChunk | None:
        """One message for the rounds ready now (several when the client reads slower than the engine
        steps): their tokens and text, every round's stats, and `round` repeating the last one. None
        when they add nothing the client needs (a round that committed nothing, not the first)."""
        shown = [r for r in rounds if r.token_ids or r.finish_reason or r.stats.index == 0]
        if not shown:
            return None
        stats = [_round_proto(r) for r in shown]
        chunk = generate_pb2.GenerateChunk(
            session_id=session_id, text="".join(r.text for r in shown),
            token_ids=[t for r in shown for t in r.token_ids], round=stats[-1], rounds=stats,
        )
        if shown[-1].finish_reason is not None:
            chunk.final.CopyFrom(_final_proto(_final_dict(shown[-1])))
        return chunk

    def _finish(self, record: SessionRecord, out: RoundOutput) -> None:
        self.store.finish(record.session_id, record.owner, FINISHED, _final_dict(out))
        self.metrics.record_request("finished", out.totals.tau, out.totals.decode_tokens_per_s)

    def _mark(self, record: SessionRecord, status: str) -> None:
        self.metrics.record_request(status)
        try:
            self.store.finish(record.session_id, record.owner, status)
        except DFlashError:
            pass  # the store is down: the session stays "running" and can still be resumed later


def _round_proto(out: RoundOutput) -> generate_pb2.RoundStats:
    s = out.stats
    return generate_pb2.RoundStats(
        index=s.index, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens, committed=s.committed,
        draft_ms=s.draft_ms, verify_ms=s.verify_ms, drafter=s.drafter,
    )


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
