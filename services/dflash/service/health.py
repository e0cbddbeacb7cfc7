"""Readiness: SERVING means a Generate would be served now, not only that Redis answers.

Each verifier replica holds a lease in Redis, the sorted set `{prefix}:verifiers` (member: the
replica's id, score: when the lease runs out), renewed every LEASE_EVERY_S for LEASE_TTL_S by a thread
that first makes sure the replica's event loop (where its streams run) answers. The ingress's health
Check is SERVING while Redis answers and at least one lease is live: NOT_SERVING while the first
verifier loads its model at start-up, within LEASE_TTL_S of the last verifier's death until its
replacement is up, and while Redis is down. A Check costs one Redis call and no verifier request
slot (a ping through Serve would wait behind a full replica's streams).

The in-process store (`memory://`, `dflash serve` without redis-server) is one process's memory, so
there the ingress asks the verifier itself (`VerifierDeployment.ready`), within PING_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from .session_store import SessionStore

log = logging.getLogger("dflash.service")

LEASE_EVERY_S = 1.0
LEASE_TTL_S = 3.0
PING_TIMEOUT_S = 2.0


def _redis(store: SessionStore) -> tuple[object, str] | None:
    """The store's Redis client and key prefix; None for the in-process store."""
    client = getattr(store, "redis", None)
    return (client, f"{store.prefix}:verifiers") if client is not None else None


class VerifierLease:
    """A verifier replica's lease, renewed by a thread while the replica's event loop answers."""

    def __init__(self, store: SessionStore, replica_id: str, loop: asyncio.AbstractEventLoop | None = None,
                 every_s: float = LEASE_EVERY_S, ttl_s: float = LEASE_TTL_S) -> None:
        self.redis = _redis(store)
        self.replica_id = replica_id
        self.loop = loop
        self.every_s = every_s
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True, name="verifier-lease")

    def start(self) -> VerifierLease:
        if self.redis is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Give the lease up (a replica shutting down is not serving)."""
        self._stop.set()
        if self.redis is not None:
            client, key = self.redis
            try:
                client.zrem(key, self.replica_id)
            except Exception:  # noqa: BLE001 - Redis down: the lease runs out by itself
                pass

    def _renew(self) -> None:
        client, key = self.redis
        while not self._stop.is_set():
            if self._loop_answers():
                try:
                    client.zadd(key, {self.replica_id: time.time() + self.ttl_s})
                except Exception as exc:  # noqa: BLE001 - Redis down: health says so anyway
                    log.debug("verifier lease not renewed: %s", exc)
            self._stop.wait(self.every_s)

    def _loop_answers(self) -> bool:
        if self.loop is None:
            return True
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result(timeout=self.ttl_s)
            return True
        except Exception:  # noqa: BLE001 - a loop that is closed or stuck for ttl_s does not serve
            log.warning("verifier event loop did not answer within %.1f s: lease not renewed", self.ttl_s)
            return False


def live_verifiers(store: SessionStore) -> int:
    """How many verifier replicas hold a live lease (expired ones are deleted); raises what the
    Redis client raises when Redis is unreachable."""
    client, key = _redis(store)
    now = time.time()
    pipe = client.pipeline()
    pipe.zremrangebyscore(key, "-inf", now)
    pipe.zcount(key, now, "+inf")
    return int(pipe.execute()[1])


class ServingCheck:
    """The ingress's answer to a health Check: whether a Generate would be served now."""

    def __init__(self, store: SessionStore, ping_verifier: Callable[[], Awaitable[object]]) -> None:
        self.store = store
        self.ping_verifier = ping_verifier  # the in-process store's way: ask a verifier replica itself

    async def serving(self) -> bool:
        try:
            if _redis(self.store) is None:
                await asyncio.wait_for(self.ping_verifier(), PING_TIMEOUT_S)
                return True
            return await asyncio.to_thread(live_verifiers, self.store) > 0
        except Exception:  # noqa: BLE001 - Redis down, no verifier answering: alive, but not ready to serve
            return False
