"""The step loop's output, fanned out to asyncio streams with one thread hand-off per step.

The engine's loop thread ends each step by publishing the sessions whose output is worth a message
(engine._publish). Thread-read streams wake one thread each; streams read from an asyncio event loop
(the verifier replica's) register here instead, so a step costs one `call_soon_threadsafe`, however
many streams it woke, and the streams then run as coroutines on that loop (vLLM V1's output handler
has the same shape: one batch per step from the engine core, fanned out to per-request queues).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import SpeculativeEngine
    from .generation import Generation, RoundOutput


class AsyncOutputs:
    """One event loop's streams of one engine (an OutputListener): attach, submit, then read `batches`."""

    def __init__(self, engine: SpeculativeEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self._ready: dict[int, asyncio.Event] = {}

    def attach(self, gen: Generation) -> None:
        """Route a request's wake-ups here; before `engine.submit(gen)` (from any thread)."""
        self._ready[id(gen)] = asyncio.Event()
        gen.listener = self

    def publish(self, gens: list[Generation]) -> None:
        """From the engine's loop thread, once per step."""
        try:
            self.loop.call_soon_threadsafe(self._wake, gens)
        except RuntimeError:  # the event loop is closed: nobody reads these streams any more
            for gen in gens:
                self.engine.cancel(gen)

    def _wake(self, gens: list[Generation]) -> None:
        for gen in gens:
            ready = self._ready.get(id(gen))
            if ready is not None:
                ready.set()

    async def batches(self, gen: Generation) -> AsyncIterator[list[RoundOutput]]:
        """What `engine.stream_batches` yields, read on this loop: every round ready when the engine
        woke the stream. Closing it early (a client gone, a task cancelled) cancels the request."""
        ready = self._ready[id(gen)]
        try:
            while True:
                if not gen.outbox and not gen.settled:  # an error after rounds still unread: no wake-up follows
                    await ready.wait()
                    ready.clear()
                rounds = gen.take_ready()
                if rounds:
                    yield rounds
                if rounds is not None and (not rounds or rounds[-1].finish_reason is not None):
                    return  # its end, or cancelled
        finally:
            self._ready.pop(id(gen), None)
            if not gen.finished:
                self.engine.cancel(gen)
