"""The session store: what a request needs to be resumed on any verifier replica, and nothing more.

Per session, in Redis:
  hash  {prefix}:s:{id}       prompt (uint32 ids), params (JSON), model, seed, status, rounds, final (JSON),
                              owner (the fencing token of the stream that may commit)
  str   {prefix}:s:{id}:out   committed token ids, little-endian uint32, appended each step
Both expire `ttl_s` after the last write. No tensors: a drafter replica that lost a session's context
gets it back from the verifier (drafter_client.py), which keeps the recent window in its own memory.
Drafter replicas advertise themselves in the sorted set `{prefix}:drafters` (member: address, score:
expiry time); expired members are removed whenever the set is read.

One owner per session: `create` gives the first stream owner token 1, and `take_over` (a resume)
atomically truncates the output to what the client received, marks the session running and raises
the token. `commit_rounds` and `finish` write only where the token they carry is still the
session's, so a stream that lost its session (a verifier behind a broken connection, a racing resume)
can no longer change it. `commit_rounds` writes the rounds of one engine step for all its sessions in
one round trip (one Lua script).

No torch here: the ingress uses this module.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, TypeVar

from ..errors import DFlashError, InvalidRequestError
from ..journal import CommittedRound
from ..params import SamplingParams
from .messages import redact_credentials

RUNNING, FINISHED, CANCELLED, FAILED = "running", "finished", "cancelled", "failed"

T = TypeVar("T")


class StoreUnavailableError(DFlashError):
    """The session store cannot be reached; the request cannot be served or resumed right now."""


class SessionNotFoundError(DFlashError):
    """No session with that id (never created, or expired)."""


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
    owner: int = 1  # fencing token of the stream allowed to commit

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.params)


class SessionStore(Protocol):
    """What the ingress, verifier and drafters need from the store. Every method may raise
    StoreUnavailableError."""

    def ping(self) -> None: ...

    def create(self, record: SessionRecord) -> None:
        """A new session, owned by record.owner (1)."""
        ...

    def get(self, session_id: str) -> SessionRecord | None: ...

    def take_over(self, session_id: str, tokens_received: int) -> SessionRecord:
        """A resume: keep the first `tokens_received` committed ids, mark the session running and make
        the caller its owner (a new token in the returned record), all at once. A finished session whose
        client has every token is returned unchanged (nothing to take over). SessionNotFoundError, or
        InvalidRequestError when tokens_received exceeds what was committed."""
        ...

    def commit_rounds(self, rounds: list[CommittedRound]) -> set[int]:
        """Append each round's tokens and count, in one round trip; the positions (in `rounds`) of the
        rounds whose owner token is no longer the session's (nothing was written for them)."""
        ...

    def finish(self, session_id: str, owner: int, status: str, final: dict | None = None) -> bool:
        """Set the final status if `owner` still owns the session; False (nothing written) if not."""
        ...

    def advertise_drafter(self, address: str, ttl_s: float) -> None: ...
    def withdraw_drafter(self, address: str) -> None: ...
    def drafters(self) -> list[str]: ...


def pack_ids(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def unpack_ids(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def _tokens_received_error(session_id: str, received: int, committed: int) -> InvalidRequestError:
    return InvalidRequestError("tokens_received", f"{received} exceeds the {committed} tokens session "
                               f"{session_id!r} has committed")


# KEYS: hash, out pairs. ARGV: ttl, then (owner, rounds, ids) per session. Returns the 1-based indices fenced.
_COMMIT = """
local ttl = tonumber(ARGV[1])
local fenced = {}
for i = 1, #KEYS / 2 do
  local h, o = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('HGET', h, 'owner') ~= ARGV[3 * i - 1] then
    fenced[#fenced + 1] = i
  else
    local ids = ARGV[3 * i + 1]
    if #ids > 0 then redis.call('APPEND', o, ids) end
    redis.call('HSET', h, 'rounds', ARGV[3 * i])
    redis.call('EXPIRE', h, ttl)
    redis.call('EXPIRE', o, ttl)
  end
end
return fenced
"""

# KEYS: hash, out. ARGV: tokens_received, ttl. Returns {code, owner, committed, out}.
_TAKE_OVER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing', 0, 0, ''} end
local out = redis.call('GET', KEYS[2]) or ''
local have = math.floor(#out / 4)
local got = tonumber(ARGV[1])
if got > have then return {'ahead', 0, have, ''} end
if redis.call('HGET', KEYS[1], 'status') == 'finished' and got == have then
  return {'finished', tonumber(redis.call('HGET', KEYS[1], 'owner')), have, out}
end
out = string.sub(out, 1, 4 * got)
redis.call('SET', KEYS[2], out, 'EX', tonumber(ARGV[2]))
local owner = redis.call('HINCRBY', KEYS[1], 'owner', 1)
redis.call('HSET', KEYS[1], 'status', 'running')
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return {'owned', owner, have, out}
"""

# KEYS: hash, out. ARGV: owner, status, final JSON, ttl. Returns 1 if written, 0 if fenced.
_FINISH = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'final', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
return 1
"""


class RedisSessionStore:
    """SessionStore on Redis (redis-py, synchronous; call from threads in async code).

    The scripts touch several keys of a session (and of many sessions in commit_rounds): one Redis, or
    a cluster with the whole key prefix in one hash slot (a `{...}` hash tag in key_prefix).
    """

    def __init__(self, url: str, ttl_s: int = 3600, prefix: str = "dflash", socket_timeout_s: float = 5.0) -> None:
        import redis

        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self.url = url
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.redis = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, retry_on_timeout=False
        )
        self._commit = self.redis.register_script(_COMMIT)
        self._take_over = self.redis.register_script(_TAKE_OVER)
        self._finish = self.redis.register_script(_FINISH)

    def _key(self, session_id: str, part: str = "") -> str:
        return f"{self.prefix}:s:{session_id}{part}"

    def _keys(self, session_id: str) -> list[str]:
        return [self._key(session_id), self._key(session_id, ":out")]

    def _run(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._errors as exc:
            raise StoreUnavailableError(
                f"session store (Redis at {redact_credentials(self.url)}) is unreachable: {exc}. "
                "Generation cannot be served or resumed until it is back; retry shortly"
            ) from None

    def ping(self) -> None:
        self._run(self.redis.ping)

    def create(self, record: SessionRecord) -> None:
        def write() -> None:
            hash_key, out_key = self._keys(record.session_id)
            pipe = self.redis.pipeline()
            pipe.delete(out_key)
            pipe.hset(hash_key, mapping={
                "prompt": pack_ids(record.prompt_ids), "params": json.dumps(record.params), "model": record.model,
                "seed": str(record.seed), "status": record.status, "rounds": record.num_rounds, "final": "{}",
                "owner": record.owner,
            })
            if record.output_ids:
                pipe.set(out_key, pack_ids(record.output_ids))
            pipe.expire(hash_key, self.ttl_s)
            pipe.expire(out_key, self.ttl_s)
            pipe.execute()

        self._run(write)

    def get(self, session_id: str) -> SessionRecord | None:
        def read() -> list:
            pipe = self.redis.pipeline()
            pipe.hgetall(self._key(session_id))
            pipe.get(self._key(session_id, ":out"))
            return pipe.execute()

        fields, out = self._run(read)
        return self._record(session_id, fields, out or b"") if fields else None

    def take_over(self, session_id: str, tokens_received: int) -> SessionRecord:
        code, owner, have, out = self._run(
            lambda: self._take_over(keys=self._keys(session_id), args=[tokens_received, self.ttl_s]))
        if code == b"missing":
            raise SessionNotFoundError(f"session_id: no session {_short(session_id)!r} (unknown or expired)")
        if code == b"ahead":
            raise _tokens_received_error(_short(session_id), tokens_received, have)
        record = self.get(session_id)
        if record is None:  # expired between the two calls
            raise SessionNotFoundError(f"session_id: no session {_short(session_id)!r} (unknown or expired)")
        record.owner, record.output_ids = int(owner), unpack_ids(out)
        return record

    def commit_rounds(self, rounds: list[CommittedRound]) -> set[int]:
        if not rounds:
            return set()
        keys, args = [], [self.ttl_s]
        for r in rounds:
            keys += self._keys(r.session_id)
            args += [r.owner, r.num_rounds, pack_ids(r.token_ids)]
        return {i - 1 for i in self._run(lambda: self._commit(keys=keys, args=args))}

    def finish(self, session_id: str, owner: int, status: str, final: dict | None = None) -> bool:
        args = [owner, status, json.dumps(final or {}), self.ttl_s]
        return bool(self._run(lambda: self._finish(keys=self._keys(session_id), args=args)))

    def advertise_drafter(self, address: str, ttl_s: float) -> None:
        self._run(lambda: self.redis.zadd(f"{self.prefix}:drafters", {address: time.time() + ttl_s}))

    def withdraw_drafter(self, address: str) -> None:
        self._run(lambda: self.redis.zrem(f"{self.prefix}:drafters", address))

    def drafters(self) -> list[str]:
        """Live drafter replicas; the entries of replicas that stopped advertising are deleted."""
        def read() -> list[bytes]:
            now, key = time.time(), f"{self.prefix}:drafters"
            pipe = self.redis.pipeline()
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zrange(key, 0, -1)
            return pipe.execute()[1]

        return sorted(m.decode() for m in self._run(read))

    def session_bytes(self, session_id: str) -> int:
        """Redis's own MEMORY USAGE of the session's keys (for tests and capacity planning)."""
        return sum(self._run(lambda k=k: self.redis.memory_usage(k, samples=0)) or 0 for k in self._keys(session_id))

    @staticmethod
    def _record(session_id: str, fields: dict, out: bytes) -> SessionRecord:
        text = {k.decode(): v for k, v in fields.items()}
        return SessionRecord(
            session_id=session_id, prompt_ids=unpack_ids(text["prompt"]), params=json.loads(text["params"]),
            seed=int(text["seed"]), model=text["model"].decode(), status=text["status"].decode(),
            num_rounds=int(text["rounds"]), output_ids=unpack_ids(out), final=json.loads(text["final"]),
            owner=int(text["owner"]),
        )


def _short(text: str, limit: int = 64) -> str:
    """Client input echoed in an error, cut to a bounded length."""
    return text if len(text) <= limit else text[:limit] + "..."


class MemorySessionStore:
    """SessionStore in this process: for one machine without redis-server (co-located mode only).

    Nothing survives a restart and other processes cannot see it; TTLs are not enforced.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, SessionRecord] = {}
        self._drafters: dict[str, float] = {}

    def ping(self) -> None:
        pass

    def create(self, record: SessionRecord) -> None:
        with self._lock:
            self._records[record.session_id] = SessionRecord(**asdict(record))

    def get(self, session_id: str) -> SessionRecord | None:
        with self._lock:
            record = self._records.get(session_id)
            return None if record is None else SessionRecord(**asdict(record))

    def take_over(self, session_id: str, tokens_received: int) -> SessionRecord:
        with self._lock:
            record = self._records.get(session_id)
            if record is None:
                raise SessionNotFoundError(f"session_id: no session {_short(session_id)!r} (unknown or expired)")
            have = len(record.output_ids)
            if tokens_received > have:
                raise _tokens_received_error(_short(session_id), tokens_received, have)
            if not (record.status == FINISHED and tokens_received == have):
                del record.output_ids[tokens_received:]
                record.status = RUNNING
                record.owner += 1
            return SessionRecord(**asdict(record))

    def commit_rounds(self, rounds: list[CommittedRound]) -> set[int]:
        fenced = set()
        with self._lock:
            for i, r in enumerate(rounds):
                record = self._records.get(r.session_id)
                if record is None or record.owner != r.owner:
                    fenced.add(i)
                    continue
                record.output_ids.extend(r.token_ids)
                record.num_rounds = r.num_rounds
        return fenced

    def finish(self, session_id: str, owner: int, status: str, final: dict | None = None) -> bool:
        with self._lock:
            record = self._records.get(session_id)
            if record is None or record.owner != owner:
                return False
            record.status = status
            record.final = dict(final or {})
            return True

    def advertise_drafter(self, address: str, ttl_s: float) -> None:
        with self._lock:
            self._drafters[address] = time.time() + ttl_s

    def withdraw_drafter(self, address: str) -> None:
        with self._lock:
            self._drafters.pop(address, None)

    def drafters(self) -> list[str]:
        now = time.time()
        with self._lock:
            for address in [a for a, t in self._drafters.items() if t <= now]:
                del self._drafters[address]
            return sorted(self._drafters)


def open_store(url: str, ttl_s: int = 3600, prefix: str = "dflash", socket_timeout_s: float = 5.0) -> SessionStore:
    """"memory://" gives the in-process store; anything else is a Redis URL."""
    if url.startswith("memory://"):
        return MemorySessionStore()
    return RedisSessionStore(url, ttl_s, prefix, socket_timeout_s)
