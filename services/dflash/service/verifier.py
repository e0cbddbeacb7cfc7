"""The verifier: owns the target's engine; turns a VerifyRequest into a stream of GenerateChunks.

The engine writes each step's rounds to the session store (one write for all sessions) before they
are streamed, so the store always holds at least what the client has received: a client that
reconnects with (session id, tokens received) is resumed by re-prefilling prompt + those tokens with
the stored seed, and position-seeded sampling regenerates exactly the tokens it has not seen. A resume
takes the session over (a new owner token): a stream still running for it elsewhere ends with ABORTED
at its next step, without writing anything more.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

from ..api.v1 import generate_pb2
from ..engine import SpeculativeEngine
from ..errors import DFlashError, InvalidRequestError
from ..generation import Generation, RoundOutput
from ..journal import SessionFencedError
from ..output_hub import AsyncOutputs
from ..params import SamplingParams
from ..scheduler import QueueFullError
from . import tracing
from .engine_process import EngineProcess, EngineProcessError
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
    """Streams GenerateChunk messages (or one StreamError) for a VerifyRequest.

    `stream_async` is the server's path: the stream is a coroutine on the caller's event loop, woken
    once per step for all its streams (output_hub.py), with the session store's calls in worker
    threads. `stream` is the same relay read from a thread (in-process uses and tests). `engine` is a
    SpeculativeEngine, or an EngineProcess (engine_process.py: the same calls, the engine in a child
    process, as `dflash serve` runs it).
    """

    def __init__(self, engine: SpeculativeEngine | EngineProcess, store: SessionStore, model_name: str = "",
                 metrics: ServiceMetrics | None = None) -> None:
        self.engine = engine
        self.store = store
        self.model_name = model_name
        self.metrics = metrics or ServiceMetrics("none")
        self._outputs: dict[int, AsyncOutputs] = {}  # per event loop

    def stream(self, request: VerifyRequest, carrier: dict | None = None,
               cancelled: threading.Event | None = None) -> Iterator[generate_pb2.GenerateChunk | StreamError]:
        cancelled = cancelled or threading.Event()
        try:
            opened = self._open(request, tracing.context_from(carrier) if carrier is not None else None)
            if not isinstance(opened, _Relay):
                yield opened
                return
            batches = self.engine.stream_batches(opened.gen)
            try:
                for rounds in batches:
                    chunk = opened.chunk(rounds)
                    if chunk is not None:
                        yield chunk
                    if opened.finished or cancelled.is_set():
                        break
            except BaseException as exc:
                opened.failed(exc)
                raise
            finally:
                batches.close()  # cancels the request in the engine unless it finished, freeing its caches
                opened.close()
        except DFlashError as exc:
            yield _stream_error(exc)

    async def stream_async(self, request: VerifyRequest,
                           carrier: dict | None = None) -> AsyncIterator[generate_pb2.GenerateChunk | StreamError]:
        outputs = self._outputs_here()
        try:
            context = tracing.context_from(carrier) if carrier is not None else None
            opening = asyncio.ensure_future(asyncio.to_thread(self._open, request, context, outputs))
            try:
                opened = await asyncio.shield(opening)
            except asyncio.CancelledError:  # the thread queues the request anyway: cancel it once queued
                opening.add_done_callback(lambda done: self._abandon(done, outputs))
                raise
            if not isinstance(opened, _Relay):
                yield opened
                return
            batches = outputs.batches(opened.gen)
            try:
                async for rounds in batches:
                    chunk = opened.chunk(rounds)
                    if chunk is not None:
                        yield chunk
                    if opened.finished:
                        break
            except BaseException as exc:
                opened.failed(exc)
                raise
            finally:
                await batches.aclose()
                await asyncio.to_thread(opened.close)
        except DFlashError as exc:
            yield _stream_error(exc)

    def _abandon(self, opening: asyncio.Future, outputs: AsyncOutputs) -> None:
        """A stream cancelled while its request was being opened: cancel the request it queued."""
        if opening.cancelled() or opening.exception() is not None or not isinstance(opening.result(), _Relay):
            return
        relay = opening.result()
        self.engine.cancel(relay.gen)

        async def drain() -> None:  # reads the cancelled stream's end, detaching it from the outputs
            try:
                async for _ in outputs.batches(relay.gen):
                    pass
            except DFlashError:
                pass  # it failed before it saw the cancel: nobody is left to tell
            await asyncio.to_thread(relay.close)

        asyncio.ensure_future(drain())

    def _outputs_here(self) -> AsyncOutputs:
        loop = asyncio.get_running_loop()
        outputs = self._outputs.get(id(loop))
        if outputs is None or outputs.loop is not loop:
            self.engine.start_loop()  # asyncio streams only read: the loop thread steps for all of them
            outputs = self._outputs[id(loop)] = AsyncOutputs(self.engine, loop)
        return outputs

    def _open(self, request: VerifyRequest, context: object,
              outputs: AsyncOutputs | None = None) -> _Relay | generate_pb2.GenerateChunk | StreamError:
        """The session created (or taken over, for a resume) and its request queued in the engine: a
        relay for its rounds, or the one message that answers it at once."""
        record = self.store.take_over(request.session_id, request.tokens_received) if request.resume \
            else self._create(request)
        if record.status == FINISHED:  # a resume of a finished session whose client has every token
            return generate_pb2.GenerateChunk(session_id=record.session_id, final=_final_proto(record.final))
        # request_id keys the engine's caches: one per owner, as a resume may start before the stream it
        # replaces has noticed; session_id is what the engine's journal commits to.
        gen = self.engine.start(record.prompt_ids, record.sampling_params(), f"{record.session_id}.{record.owner}",
                                committed_ids=record.output_ids or None, seed=record.seed,
                                stream_interval_ms=request.stream_interval_ms)
        gen.session_id, gen.owner = record.session_id, record.owner
        gen.trace_context = context if context is not None else tracing.otel_context.get_current()
        if outputs is not None:  # before it is queued: wake-ups must reach the loop from the first step on
            outputs.attach(gen)
        try:
            self.engine.submit(gen)
        except QueueFullError as exc:
            self._mark(record, FAILED)
            return StreamError("RESOURCE_EXHAUSTED", str(exc))
        return _Relay(self, record, gen)

    def _create(self, request: VerifyRequest) -> SessionRecord:
        params = SamplingParams(**request.params)
        prompt_ids = list(request.prompt_ids) or self.engine.encode(request.prompt_text)
        if not prompt_ids:
            raise InvalidRequestError("prompt", "encodes to no tokens; give a longer prompt")
        gen = self.engine.start(prompt_ids, params, request.session_id)  # validates prompt, block size, stops
        record = SessionRecord(request.session_id, gen.prompt_ids, dict(request.params), gen.seed, self.model_name)
        self.store.create(record)
        return record

    def _finish(self, record: SessionRecord, out: RoundOutput) -> None:
        self.store.finish(record.session_id, record.owner, FINISHED, _final_dict(out))
        self.metrics.record_request("finished", out.totals.tau, out.totals.decode_tokens_per_s)

    def _mark(self, record: SessionRecord, status: str) -> None:
        self.metrics.record_request(status)
        try:
            self.store.finish(record.session_id, record.owner, status)
        except DFlashError:
            pass  # the store is down: the session stays "running" and can still be resumed later


class _Relay:
    """One open request's rounds turned into chunks, and the session's status when its stream ends."""

    def __init__(self, verifier: Verifier, record: SessionRecord, gen: Generation) -> None:
        self.verifier = verifier
        self.record = record
        self.gen = gen
        self.status: str | None = CANCELLED  # what the session becomes if the stream ends unfinished
        self.last: RoundOutput | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finish_reason is not None

    def chunk(self, rounds: list[RoundOutput]) -> generate_pb2.GenerateChunk | None:
        """One message for the rounds ready now (several when the engine gathered them for the stream
        interval): their tokens and text, every round's stats, and `round` repeating the last one. None
        when they add nothing the client needs (a round that committed nothing, not the first)."""
        self.last = rounds[-1]
        shown = [r for r in rounds if r.token_ids or r.finish_reason or r.stats.index == 0]
        if not shown:
            return None
        stats = [_round_proto(r) for r in shown]
        chunk = generate_pb2.GenerateChunk(
            session_id=self.record.session_id, text="".join(r.text for r in shown),
            token_ids=[t for r in shown for t in r.token_ids], round=stats[-1], rounds=stats,
        )
        if shown[-1].finish_reason is not None:
            chunk.final.CopyFrom(_final_proto(_final_dict(shown[-1])))
        return chunk

    def failed(self, exc: BaseException) -> None:
        if isinstance(exc, SessionFencedError):
            self.status = None  # the session is someone else's now: leave its status alone
        elif not isinstance(exc, (GeneratorExit, asyncio.CancelledError)):  # not the consumer going away
            self.status = FAILED

    def close(self) -> None:
        """The stream ended: record how (finished, cancelled, failed; nothing when fenced)."""
        if self.finished:
            self.verifier._finish(self.record, self.last)
        elif self.status is not None:
            self.verifier._mark(self.record, self.status)


def _stream_error(exc: DFlashError) -> StreamError:
    """The gRPC error a client gets for what ended its request (re-raised when it is our own fault)."""
    for kind, code in ((InvalidRequestError, "INVALID_ARGUMENT"), (SessionNotFoundError, "NOT_FOUND"),
                       (SessionFencedError, "ABORTED"), (StoreUnavailableError, "UNAVAILABLE"),
                       (EngineProcessError, "UNAVAILABLE")):
        if isinstance(exc, kind):
            return StreamError(code, str(exc))
    raise exc


def _round_proto(out: RoundOutput) -> generate_pb2.RoundStats:
    s = out.stats
    return generate_pb2.RoundStats(
        index=s.index, draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens, committed=s.committed,
        draft_ms=s.draft_ms, verify_ms=s.verify_ms, drafter=s.drafter, policy_arm=s.policy_arm,
        policy_reason=s.policy_reason,
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
