"""Who reads the verifier's streams: the ingress replicas, watched so that a dead one's streams stop.

A verifier stream is a Ray streaming call made by an ingress replica. When that replica dies (killed,
its node lost), Ray does not stop the call: the verifier's generator runs to its last token for
nobody (measured: 8-14 s of an orphaned stream). So each stream names its consumer (the ingress
replica's actor, `Consumer.here()`), and the verifier replica probes every consumer it streams to
every PROBE_EVERY_S; once Ray says the actor is gone, that consumer's streams are cancelled, and the
engine retires their sessions at its next step (the session stays resumable in the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger("dflash.service")

PROBE_EVERY_S = 0.25
PROBE_TIMEOUT_S = 5.0  # a probe this late proves nothing either way (a busy node): the next one decides


@dataclass(frozen=True)
class Consumer:
    """A Ray actor that reads streams: its id and a handle to probe it with."""

    actor_id: str
    handle: object  # ray.actor.ActorHandle

    @classmethod
    def here(cls) -> Consumer | None:
        """The calling Ray actor (an ingress replica), None outside one."""
        import ray

        context = ray.get_runtime_context()
        actor_id = context.get_actor_id()
        return cls(actor_id, context.current_actor) if actor_id else None


class ConsumerWatch:
    """Cancels the streams (asyncio tasks, on one event loop) of consumers that Ray reports dead."""

    def __init__(self, probe_every_s: float = PROBE_EVERY_S, probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.probe_every_s = probe_every_s
        self.probe_timeout_s = probe_timeout_s
        self._streams: dict[str, set[asyncio.Task]] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self.num_cancelled = 0

    @contextlib.contextmanager
    def track(self, consumer: Consumer | None) -> Iterator[None]:
        """While inside, the current task is a stream read by `consumer` (nothing when None)."""
        task = asyncio.current_task()
        if consumer is None or task is None:
            yield
            return
        streams = self._streams.setdefault(consumer.actor_id, set())
        streams.add(task)
        if consumer.actor_id not in self._probes:
            self._probes[consumer.actor_id] = asyncio.ensure_future(self._probe(consumer))
        try:
            yield
        finally:
            streams.discard(task)

    async def _probe(self, consumer: Consumer) -> None:
        from ray.exceptions import RayActorError

        key = consumer.actor_id
        try:
            while self._streams.get(key):
                await asyncio.sleep(self.probe_every_s)
                try:
                    await asyncio.wait_for(consumer.handle.__ray_ready__.remote(), self.probe_timeout_s)
                except RayActorError:
                    streams = self._streams.pop(key, set())
                    log.warning("ingress replica %s is gone: cancelling its %d streams", key, len(streams))
                    for task in streams:
                        task.cancel()
                    self.num_cancelled += len(streams)
                    return
                except TimeoutError:
                    continue
        finally:
            self._probes.pop(key, None)
            if not self._streams.get(key):
                self._streams.pop(key, None)
