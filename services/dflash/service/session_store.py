"""The session store: everything needed to recover a request, in Redis (or in process for one machine).

Per session, under `{prefix}:s:{id}`:
  hash  {prefix}:s:{id}       request (JSON: prompt ids, sampling params, model), seed, status, rounds, final
  str   {prefix}:s:{id}:out   committed token ids, little-endian uint32, appended each round
  list  {prefix}:s:{id}:ctx   the drafter's context log: packed feature slices (see codec.pack_log_entry)
All three expire `ttl_s` after the last write. Drafter replicas advertise themselves in the sorted set
`{prefix}:drafters` (member: address, score: expiry time).

No torch here: the ingress uses this module. The context log is opaque bytes at this level.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from ..errors import DFlashError
from ..params import SamplingParams

RUNNING, FINISHED, CANCELLED, FAILED = "running", "finished", "cancelled", "failed"


class StoreUnavailableError(DFlashError):
    """The session store cannot be reached; the request cannot be served or resumed right now."""


@dataclass
class SessionRecord:
    """A request as the store keeps it: enough to resume it exactly on any verifier replica."""

    session_id: str
    prompt_ids: list[int]
    params: dict  # SamplingParams fields
    seed: int
    model: str = ""
    status: str = RUNNING
    num_rounds: int = 0
    output_ids: list[int] = field(default_factory=list)
    final: dict = field(default_factory=dict)  # the final chunk's numbers, once finished

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.params)


class SessionStore(Protocol):
    """What the ingress, verifier and drafters need from the store. Every method may raise
    StoreUnavailableError."""

    def ping(self) -> None: ...
    def create(self, record: SessionRecord) -> None: ...
    def get(self, session_id: str) -> SessionRecord | None: ...
    def commit(self, session_id: str, new_ids: list[int], num_rounds: int) -> None: ...
    def finish(self, session_id: str, status: str, final: dict | None = None) -> None: ...
    def truncate_output(self, session_id: str, length: int) -> None: ...
    def append_context(self, session_id: str, entry: bytes, reset: bool = False, keep_entries: int = 0) -> None: ...
    def context_log(self, session_id: str) -> list[bytes]: ...
    def advertise_drafter(self, address: str, ttl_s: float) -> None: ...
    def withdraw_drafter(self, address: str) -> None: ...
    def drafters(self) -> list[str]: ...


def pack_ids(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


class RedisSessionStore:
    """SessionStore on Redis (redis-py, synchronous; call from threads in async code)."""

    def __init__(self, url: str, ttl_s: int = 3600, prefix: str = "dflash", socket_timeout_s: float = 5.0):
        import redis

        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, retry_on_timeout=False
        )

    def _key(self, session_id: str, part: str = "") -> str:
        return f"{self.prefix}:s:{session_id}{part}"

    def _run(self, fn):
        try:
            return fn()
        except self._errors as exc:
            raise StoreUnavailableError(
                f"session store (Redis at {self.url}) is unreachable: {exc}. Generation cannot be served "
                "or resumed until it is back; retry shortly"
            ) from None

    def _expire_all(self, pipe, session_id: str) -> None:
        for part in ("", ":out", ":ctx"):
            pipe.expire(self._key(session_id, part), self.ttl_s)

    def ping(self) -> None:
        self._run(self.redis.ping)

    def create(self, record: SessionRecord) -> None:
        request = {"prompt_ids": record.prompt_ids, "params": record.params, "model": record.model}

        def write():
            pipe = self.redis.pipeline()
            pipe.delete(self._key(record.session_id, ":out"), self._key(record.session_id, ":ctx"))
            pipe.hset(self._key(record.session_id), mapping={
                "request": json.dumps(request), "seed": str(record.seed), "status": record.status,
                "rounds": record.num_rounds, "final": "{}",
            })
            if record.output_ids:
                pipe.set(self._key(record.session_id, ":out"), pack_ids(record.output_ids))
            self._expire_all(pipe, record.session_id)
            pipe.execute()

        self._run(write)

    def get(self, session_id: str) -> SessionRecord | None:
        def read():
            pipe = self.redis.pipeline()
            pipe.hgetall(self._key(session_id))
            pipe.get(self._key(session_id, ":out"))
            return pipe.execute()

        fields, out = self._run(read)
        if not fields:
            return None
        fields = {k.decode(): v.decode() for k, v in fields.items()}
        request = json.loads(fields["request"])
        return SessionRecord(
            session_id=session_id, prompt_ids=request["prompt_ids"], params=request["params"],
            seed=int(fields["seed"]), model=request.get("model", ""), status=fields["status"],
            num_rounds=int(fields["rounds"]), output_ids=unpack_ids(out or b""), final=json.loads(fields["final"]),
        )

    def commit(self, session_id: str, new_ids: list[int], num_rounds: int) -> None:
        def write():
            pipe = self.redis.pipeline()
            if new_ids:
                pipe.append(self._key(session_id, ":out"), pack_ids(new_ids))
            pipe.hset(self._key(session_id), "rounds", num_rounds)
            self._expire_all(pipe, session_id)
            pipe.execute()

        self._run(write)

    def truncate_output(self, session_id: str, length: int) -> None:
        """Keep the first `length` committed ids (a resumed request regenerates the rest identically)."""
        def write():
            key = self._key(session_id, ":out")
            data = self.redis.get(key) or b""
            self.redis.set(key, data[: 4 * length], ex=self.ttl_s)

        self._run(write)

    def finish(self, session_id: str, status: str, final: dict | None = None) -> None:
        def write():
            pipe = self.redis.pipeline()
            pipe.hset(self._key(session_id), mapping={"status": status, "final": json.dumps(final or {})})
            self._expire_all(pipe, session_id)
            pipe.execute()

        self._run(write)

    def append_context(self, session_id: str, entry: bytes, reset: bool = False, keep_entries: int = 0) -> None:
        """Append one log entry; `reset` starts the log afresh; keep_entries > 0 keeps only the newest."""
        key = self._key(session_id, ":ctx")

        def write():
            pipe = self.redis.pipeline()
            if reset:
                pipe.delete(key)
            pipe.rpush(key, entry)
            if keep_entries > 0:
                pipe.ltrim(key, -keep_entries, -1)
            pipe.expire(key, self.ttl_s)
            pipe.execute()

        self._run(write)

    def context_log(self, session_id: str) -> list[bytes]:
        return self._run(lambda: self.redis.lrange(self._key(session_id, ":ctx"), 0, -1))

    def advertise_drafter(self, address: str, ttl_s: float) -> None:
        self._run(lambda: self.redis.zadd(f"{self.prefix}:drafters", {address: time.time() + ttl_s}))

    def withdraw_drafter(self, address: str) -> None:
        self._run(lambda: self.redis.zrem(f"{self.prefix}:drafters", address))

    def drafters(self) -> list[str]:
        members = self._run(lambda: self.redis.zrangebyscore(f"{self.prefix}:drafters", time.time(), "+inf"))
        return sorted(m.decode() for m in members)


class MemorySessionStore:
    """SessionStore in this process: for one machine without redis-server (co-located mode only).

    Nothing survives a restart and other processes cannot see it; TTLs are not enforced.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._records: dict[str, SessionRecord] = {}
        self._logs: dict[str, list[bytes]] = {}
        self._drafters: dict[str, float] = {}

    def ping(self) -> None:
        pass

    def create(self, record: SessionRecord) -> None:
        with self._lock:
            self._records[record.session_id] = SessionRecord(**asdict(record))
            self._logs.pop(record.session_id, None)

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            record = self._records.get(session_id)
            return None if record is None else SessionRecord(**asdict(record))

    def commit(self, session_id: str, new_ids: list[int], num_rounds: int) -> None:
        with self._lock:
            record = self._records[session_id]
            record.output_ids.extend(new_ids)
            record.num_rounds = num_rounds

    def truncate_output(self, session_id: str, length: int) -> None:
        with self._lock:
            del self._records[session_id].output_ids[length:]

    def finish(self, session_id: str, status: str, final: dict | None = None) -> None:
        with self._lock:
            self._records[session_id].status = status
            self._records[session_id].final = dict(final or {})

    def append_context(self, session_id: str, entry: bytes, reset: bool = False, keep_entries: int = 0) -> None:
        with self._lock:
            log = [] if reset else self._logs.get(session_id, [])
            log.append(entry)
            self._logs[session_id] = log[-keep_entries:] if keep_entries > 0 else log

    def context_log(self, session_id: str) -> list[bytes]:
        with self._lock:
            return list(self._logs.get(session_id, []))

    def advertise_drafter(self, address: str, ttl_s: float) -> None:
        with self._lock:
            self._drafters[address] = time.time() + ttl_s

    def withdraw_drafter(self, address: str) -> None:
        with self._lock:
            self._drafters.pop(address, None)

    def drafters(self) -> list[str]:
        now = time.time()
        with self._lock:
            return sorted(a for a, t in self._drafters.items() if t > now)


def open_store(url: str, ttl_s: int = 3600, prefix: str = "dflash", socket_timeout_s: float = 5.0) -> SessionStore:
    """"memory://" gives the in-process store; anything else is a Redis URL."""
    if url.startswith("memory://"):
        return MemorySessionStore()
    return RedisSessionStore(url, ttl_s, prefix, socket_timeout_s)
