"""Drafting beside verification, for drafters on devices of their own (remote drafter replicas).

The serial step drafts every decoding session, then verifies them all: the target's device idles while
the drafters run, and the drafters' while the target runs. Pipelined, the running sessions form two
cohorts that take turns: while the target verifies cohort A with the drafts it already holds, the
drafters draft cohort B from the features B's last verification produced; next step the roles swap.
Each session still alternates draft -> verify with the very same requests as in the serial step, so
its outputs and every round's acceptance are the serial step's; what changes is that a session gets
a round every other step, and a step costs max(verify A, draft B) instead of draft + verify.

Cohorts form by themselves: sessions that hold a draft verify, sessions that verified last step draft.
A step where too many sessions would draft (new arrivals, a switch from plain decoding) launches
only about half of the sessions in both groups and keeps the rest waiting one step, which evens the
cohorts out within a step; a session that would otherwise sit out a step alone (a lone stream) has
its draft waited for at once: the serial step.

Drafts run in one worker thread (a drafter call waits on the network or another device and releases
the GIL); a failed draft call becomes an empty draft, so its sessions decode plainly for that round.
"""

from __future__ import annotations

import contextvars
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from .drafter.protocol import Draft, Drafter, DraftRequest
from .errors import DFlashError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldDraft:
    """A session's draft, ready for its next verification; `ms`: how long the drafter call took."""

    draft: Draft
    ms: float


def cohort_split(fresh: int, ready: int) -> int:
    """How many of the `fresh` sessions (verified last step, no draft) to launch drafts for when `ready`
    sessions hold drafts and verify now: about half of both groups, so next step's verifying cohort
    (those launched) is as large as its drafting one (those verifying now, and those kept waiting)."""
    return min(fresh, -(-(fresh + ready) // 2))


class DraftPipeline:
    """The drafts in flight and the drafts held, for one engine. Used under the engine's lock only."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="dflash-drafts")
        self._held: dict[str, HeldDraft] = {}  # request_id -> its next verification's draft
        self._flight: tuple[list[str], Future] | None = None

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def in_flight(self, request_id: str) -> bool:
        return self._flight is not None and request_id in self._flight[0]

    def launch(self, request_ids: list[str], requests: list[DraftRequest]) -> None:
        """Start drafting these sessions; the result is theirs after the next `collect`. The caller's
        context (its tracing span) goes with the call."""
        self.collect()  # one call in flight at a time (normally collected already)
        context = contextvars.copy_context()
        self._flight = (request_ids, self._worker.submit(context.run, _timed, self.drafter, requests))

    def collect(self) -> float:
        """Wait for the drafts in flight, if any, and hold them; -> milliseconds waited."""
        if self._flight is None:
            return 0.0
        t0 = time.perf_counter()
        ids, future = self._flight
        self._flight = None
        try:
            drafts, ms = future.result()
        except DFlashError as exc:  # the round decodes plainly; the drafter client logs its own failures
            log.warning("draft call failed for %d sessions: %s", len(ids), exc)
            drafts, ms = [Draft.none()] * len(ids), 0.0
        for request_id, draft in zip(ids, drafts):
            self._held[request_id] = HeldDraft(draft, ms)
        return (time.perf_counter() - t0) * 1000

    def take(self, request_id: str, keep: int) -> HeldDraft | None:
        """A session's held draft, its first `keep` proposals, handed over once."""
        held = self._held.pop(request_id, None)
        if held is None or held.draft.tokens.shape[0] <= keep:
            return held
        d = held.draft
        return HeldDraft(Draft(d.tokens[:keep], d.probs[:keep], d.replica), held.ms)

    def drop(self, request_id: str) -> None:
        """Forget a session (retired). The drafts in flight are waited for first, so that the drafter is
        never told to release a session while it drafts (an in-process drafter's cache is not
        thread-safe); a session retires after a step's verification, when they are about done anyway."""
        self.collect()
        self._held.pop(request_id, None)

    def close(self) -> None:
        self.collect()
        self._worker.shutdown(wait=True)


def _timed(drafter: Drafter, requests: list[DraftRequest]) -> tuple[list[Draft], float]:
    t0 = time.perf_counter()
    drafts = drafter.draft_batch(requests)
    return drafts, (time.perf_counter() - t0) * 1000
