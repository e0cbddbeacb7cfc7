"""A step's rounds delivered: made durable (the journal), then put in their streams' outboxes and the
streams woken, in step order.

The engine hands each step's rounds here as the step ends. Without a journal, or without the engine's
loop, they are delivered at once, in the step's thread. With both, a thread of its own delivers them
while the next step computes: the journal's round trip (a Redis script and its fsync, ~0.5 ms a step
on the demo pair's 2-core CPU, 5% of an 8-session plain step) leaves the step's critical path, and a
round is still never streamed before it is stored. At most one step is in flight: the next one waits
for it, so rounds reach the store and their streams in the order they were made.

A stream learns that it ended (its last round, or its error) from `Generation.ended`, which only
delivery sets: the engine may have finished a session (or failed its step) a step before the rounds
it made before that are delivered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .errors import DFlashError
from .generation import Generation, RoundOutput
from .journal import CommittedRound, RoundJournal, SessionFencedError

log = logging.getLogger(__name__)


class StepDelivery:
    """The engine's side of its streams: `deliver` once per step, from the engine's thread only."""

    def __init__(self, journal: RoundJournal | None, wake: Callable[[list[Generation]], None]) -> None:
        self.journal = journal
        self.wake = wake  # wakes the streams whose output is worth a message (engine._publish)
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None

    def run_beside(self) -> None:
        """Deliver in a thread of its own from now on (the engine's loop calls this as it starts); only
        where there is a journal to wait for."""
        if self.journal is not None and self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-delivery")

    def deliver(self, rounds: list[tuple[Generation, RoundOutput]], stepped: list[Generation]) -> None:
        """A step's rounds and every session it stepped (those whose step failed carry its error)."""
        if self._executor is None:
            self._deliver(rounds, stepped)
            return
        self.flush()
        self._in_flight = self._executor.submit(self._deliver, rounds, stepped)

    def flush(self) -> None:
        """Wait for the step in flight (if any) to be delivered."""
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None

    def _deliver(self, rounds: list[tuple[Generation, RoundOutput]], stepped: list[Generation]) -> None:
        try:
            for gen, out in self._journal(rounds):
                gen.outbox.append(out)
                if out.finish_reason is not None:
                    gen.ended = True
        except Exception as exc:  # noqa: BLE001 - a bug here must end these streams, not hang them
            log.exception("delivering a step failed")
            for gen in stepped:
                gen.error = gen.error or exc
        for gen in stepped:
            if gen.error is not None:
                gen.ended = True
        self.wake(stepped)

    def _journal(self, rounds: list[tuple[Generation, RoundOutput]]) -> list[tuple[Generation, RoundOutput]]:
        """The rounds that may be streamed: stored first (one write for all sessions). A session taken
        over by another stream fails, and every stored session fails when the store is down; so does
        every later round of a session that failed (a step computed while the failing one was written)."""
        rounds = [(g, out) for g, out in rounds if g.error is None]
        stored = [(g, out) for g, out in rounds if g.session_id is not None]
        if self.journal is None or not stored:
            return rounds
        committed = [CommittedRound(g.session_id, g.owner, out.token_ids, out.stats.index) for g, out in stored]
        try:
            fenced = self.journal.commit_rounds(committed)
        except DFlashError as exc:
            for gen, _ in stored:
                gen.error = exc
            return [(g, out) for g, out in rounds if g.session_id is None]
        lost = {id(stored[i][0]) for i in fenced}
        for gen, _ in stored:
            if id(gen) in lost:
                gen.error = SessionFencedError(
                    f"session_id: {gen.session_id} was taken over by a newer stream (a resume); this stream ends here")
        return [(g, out) for g, out in rounds if id(g) not in lost]
