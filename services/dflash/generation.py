"""The state of one request: everything its next round needs, in one object."""

from __future__ import annotations

import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import torch

from .drafter.protocol import DraftSampling
from .params import SamplingParams
from .rounds import cut_at_stop
from .stats import GenerationStats, RoundStats
from .textstream import TextStream


class OutputListener(Protocol):
    """Where the step loop hands the streams it wakes (called from the engine's loop thread)."""

    def publish(self, gens: list[Generation]) -> None:
        """These sessions have output worth sending (or ended): called once per step, never blocks."""
        ...


def wake(gens: list[Generation]) -> None:
    """Wake these streams: one `publish` per listener (an asyncio consumer) for all its streams, a
    thread's event for the others."""
    listeners: dict[int, tuple[OutputListener, list[Generation]]] = {}
    for gen in gens:
        if gen.listener is None:
            gen.wakeup.set()
        else:
            listeners.setdefault(id(gen.listener), (gen.listener, []))[1].append(gen)
    for listener, woken in listeners.values():
        listener.publish(woken)


@dataclass(frozen=True)
class RoundOutput:
    """What one round adds to the stream: committed token ids, their text, and the round's numbers.

    `totals` is the request's running statistics (the same object every round).
    finish_reason is None while the request goes on, else "stop" (stop token or string) or "length".
    """

    token_ids: list[int]
    text: str
    stats: RoundStats
    totals: GenerationStats
    finish_reason: str | None = None


@dataclass
class Generation:
    """One request in flight.

    Sequence positions: prompt tokens, then `output_ids`. The last committed token sits at `position`
    and has not been through the target yet; once prefilled, the target cache holds positions
    [0, position). Until then `num_cached` counts the prefilled positions of `prefill_ids` (the prompt,
    or prompt + committed tokens but the last for a resumed request), which the scheduler feeds in
    chunks. `pending_features` are target features of positions [drafter_start, num_cached) that the
    drafter has not seen. GPU caches are disposable: prompt_ids + output_ids + seed rebuild everything.

    The engine appends what each step adds for this request to `outbox`; when it is worth a message
    (`worth_streaming`) it sets `wakeup`, or tells `listener` (an asyncio consumer: one call per step for
    all its streams). The stream reads the outbox, never waiting on the engine's lock.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    block_size: int
    stop_token_ids: frozenset[int]
    seed: int = field(default_factory=lambda: secrets.randbits(62))
    output_ids: list[int] = field(default_factory=list)
    pending_features: list[torch.Tensor] = field(default_factory=list)
    drafter_start: int = 0
    text: TextStream | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finish_reason: str | None = None
    num_rounds: int = 0
    prefill_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    reserved_tokens: int = 0
    outbox: deque = field(default_factory=deque)
    wakeup: threading.Event = field(default_factory=threading.Event)
    listener: OutputListener | None = None
    """Woken instead of `wakeup` when set: one call per step for all of its streams (output_hub.py)."""
    stream_interval_s: float | None = None
    """This request's stream interval; None: the engine's (scheduler.stream_interval_ms)."""
    woken_at: float | None = None
    """When the engine last woke the stream for output (perf_counter seconds)."""
    cancelled: bool = False
    retired: bool = False
    error: BaseException | None = None
    ended: bool = False
    """Its last round or its error is delivered (delivery.py): the stream reads to its end. The engine
    may have finished it, or failed it, a step before the rounds it made earlier are delivered."""
    session_id: str | None = None
    """The stored session this request commits its rounds to (journal.py); None: not stored. Distinct
    from request_id, which keys the caches: a resume may run while the stream it replaces still does."""
    owner: int = 1
    """The fencing token this request's stream holds on its stored session."""
    trace_context: object = None
    """An OpenTelemetry context the request's round spans are children of (None: untraced)."""

    @cached_property
    def draft_sampling(self) -> DraftSampling:
        """How the drafter picks proposals for this request (read once: params and seed are fixed)."""
        return DraftSampling.for_request(self.params, self.seed)

    @property
    def position(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prefill_ids)

    @property
    def done(self) -> bool:
        """Nothing more will be computed for it: finished, cancelled or failed."""
        return self.finished or self.cancelled or self.error is not None

    @property
    def settled(self) -> bool:
        """Nothing more will reach the outbox: its end delivered, or cancelled (the stream's side)."""
        return self.ended or self.cancelled

    def worth_streaming(self, now: float, interval_s: float) -> bool:
        """Is what the outbox holds worth waking the stream for at `now` (perf_counter seconds)? Its first
        token, its end and an error are at once; other rounds once `interval_s` has passed since the
        stream was last woken for output (the request's own interval when it set one)."""
        if self.settled:
            return True
        if not self.outbox:
            return False
        if self.stream_interval_s is not None:
            interval_s = self.stream_interval_s
        return self.woken_at is None or now - self.woken_at >= interval_s  # never woken: its first output

    def take_ready(self) -> list[RoundOutput] | None:
        """The stream's side, when woken: every round the outbox holds (up to and including the last
        one); raises the request's error once its rounds are read and it is delivered; [] when it was
        cancelled; None while nothing is there yet."""
        rounds: list[RoundOutput] = []
        while self.outbox and (not rounds or rounds[-1].finish_reason is None):
            rounds.append(self.outbox.popleft())
        if rounds:
            return rounds
        if self.error is not None and self.ended:
            raise self.error
        return [] if self.cancelled else None

    def emit(self, max_positions: int, new_tokens: list[int], stats: RoundStats) -> RoundOutput:
        """Commit what a round accepted, as far as stops, max_new_tokens and the context allow; the round
        as streamed (its tokens, their text, why it finished)."""
        cut = cut_at_stop(new_tokens, self.stop_token_ids, self.remaining)
        tokens, reason, text = cut.tokens, cut.finish_reason, ""
        if self.text is not None:
            delta = self.text.push(tokens)
            if delta.stop_at_token is not None:
                tokens, reason = tokens[: delta.stop_at_token - len(self.output_ids)], "stop"
            text = delta.text
        self.output_ids.extend(tokens)
        if reason is None and self.position + 1 >= max_positions:
            reason = "length"
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.stats.ttft_s = now - self.started
        if reason is not None:
            self.finish_reason = reason
            if self.text is not None:
                text += self.text.flush().text
        stats = replace(stats, emitted=len(tokens))
        self.num_rounds = stats.index
        self.stats.add_round(stats)
        self.stats.generated_tokens = len(self.output_ids)
        self.stats.decode_s = now - self.first_token_at
        return RoundOutput(tokens, text, stats, self.stats, reason)
