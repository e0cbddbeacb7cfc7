"""Key/value memory of one model as a preallocated pool of pages, a block table per session.

nano-vllm's block manager and vLLM's paged KV cache, without prefix sharing: the pool holds, for all
layers, keys and values as [layers, pages, page_tokens, kv_heads, head_dim] (the layout paged attention
kernels read), allocated once. A session owns a list of page ids (its block table): position p lives at
page table[p // page_tokens], row p % page_tokens. Pages are taken from a free list as a session grows
and returned when it ends, so a steady-state step allocates no tensor.

Memory is accounted in tokens against the budget: a session reserves the most tokens it can ever hold
when it is admitted, so a running session never runs out and admission is the only place where the
budget can say no. The pool has one page per session more than the budget needs (each session's last
page may be part empty), so reservations that fit the budget always find their pages. Rolling back
rejected draft tokens only lowers `length`: the rejected
positions are overwritten by the next round. A pool made `growable` (the drafter's, bounded by sessions,
not bytes) doubles when a reservation does not fit instead of refusing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import DFlashError


class CacheFullError(DFlashError):
    """A reservation larger than what the cache budget has left."""


@dataclass(frozen=True)
class CacheShape:
    """What one cached token costs: per layer, kv_heads x head_dim keys and as many values."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class _Table:
    __slots__ = ("pages", "length", "reserved")

    def __init__(self, reserved: int) -> None:
        self.pages: list[int] = []
        self.length = 0
        self.reserved = reserved


class BlockManager:
    """Pages of one model's KV pool, lent to sessions: `budget_tokens` positions in all, for at most
    `max_sessions` sessions at once (growable: both double when needed)."""

    def __init__(self, shape: CacheShape, budget_tokens: int, page_tokens: int = 16, max_sessions: int = 16,
                 growable: bool = False, spare_tokens: int = 0) -> None:
        if budget_tokens < 1:
            raise DFlashError(f"cache budget: {budget_tokens} tokens; give at least one")
        if page_tokens < 1 or max_sessions < 1:
            raise DFlashError(f"cache: page size {page_tokens} and max sessions {max_sessions} must be positive")
        self.shape = shape
        self.page_tokens = page_tokens
        self.growable = growable
        self.budget_tokens = budget_tokens
        self.max_sessions = max_sessions
        self.spare_tokens = spare_tokens
        self.num_pages = self.pages_for(budget_tokens) + max_sessions + self.pages_for(spare_tokens)
        self.keys = self._new_pool(self.num_pages)
        self.values = self._new_pool(self.num_pages)
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: low ids first
        self._tables: dict[str, _Table] = {}
        self._spare: str | None = None
        self.reserved_tokens = 0

    # -- accounting -------------------------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_tokens)

    def can_reserve(self, tokens: int) -> bool:
        return self.growable or (self.reserved_tokens + tokens <= self.budget_tokens
                                 and self.num_sessions < self.max_sessions)

    def reserve(self, session_id: str, tokens: int) -> None:
        """Admit a session that may hold up to `tokens` positions; CacheFullError when they do not fit."""
        if session_id in self._tables:
            raise DFlashError(f"cache: session {session_id!r} already has a block table")
        if not self.can_reserve(tokens):
            raise CacheFullError(f"cache: {tokens} tokens for one more session do not fit; "
                                 f"{self.budget_tokens - self.reserved_tokens} of {self.budget_tokens} tokens and "
                                 f"{self.max_sessions - self.num_sessions} of {self.max_sessions} sessions are free")
        if self.growable and (self.reserved_tokens + tokens > self.budget_tokens
                              or self.num_sessions >= self.max_sessions):
            self._grow(self.reserved_tokens + tokens, self.num_sessions + 1)
        self._tables[session_id] = _Table(tokens)
        self.reserved_tokens += tokens

    def reserve_spare(self, session_id: str) -> None:
        """Give the spare tokens to one internal session, outside the budget and the session count."""
        if self._spare is not None or not self.spare_tokens:
            raise DFlashError("cache: the spare tokens are already taken, or there are none")
        self._spare = session_id
        self._tables[session_id] = _Table(self.spare_tokens)

    def free(self, session_id: str) -> None:
        table = self._tables.pop(session_id, None)
        if table is not None:
            self._free.extend(reversed(table.pages))
            self.reserved_tokens -= table.reserved

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._tables

    @property
    def num_sessions(self) -> int:
        return len(self._tables) - (self._spare is not None)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pages sessions hold now (the pool itself is allocated once, at start)."""
        held = sum(len(t.pages) for sid, t in self._tables.items() if sid != self._spare)
        return held * self.page_tokens * self.shape.bytes_per_token

    # -- tables -----------------------------------------------------------------------------------

    def length(self, session_id: str) -> int:
        return self._tables[session_id].length

    def crop(self, session_id: str, length: int) -> None:
        """Keep the first `length` positions (drop rejected draft tokens); never grows. Pages stay with
        the session (they are reserved for it anyway) and are overwritten by its next tokens."""
        table = self._tables[session_id]
        table.length = min(table.length, length)

    def extend(self, session_id: str, start: int, n: int) -> list[int]:
        """Make room for positions start..start+n-1 (`start` <= the session's length) and set its length
        to start + n; returns the session's block table (page ids, in position order)."""
        table = self._tables[session_id]
        end = start + n
        if start > table.length:
            raise DFlashError(f"cache: session {session_id!r} holds {table.length} positions, "
                              f"a write starts at {start}")
        if end > table.reserved:
            raise DFlashError(f"cache: session {session_id!r} reserved {table.reserved} positions, needs {end}")
        needed = self.pages_for(end)
        while len(table.pages) < needed:
            table.pages.append(self._free.pop())
        table.length = end
        return table.pages

    def block_table(self, session_id: str) -> list[int]:
        return self._tables[session_id].pages

    def slots(self, pages: list[int], start: int, n: int) -> list[int]:
        """Flat slot ids (page * page_tokens + row) of positions start..start+n-1 in a block table."""
        size = self.page_tokens
        return [pages[p // size] * size + p % size for p in range(start, start + n)]

    # -- pool -------------------------------------------------------------------------------------

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [pages * page_tokens, kv_heads, head_dim] views."""
        s = self.shape
        return (self.keys[layer].view(-1, s.num_kv_heads, s.head_dim),
                self.values[layer].view(-1, s.num_kv_heads, s.head_dim))

    def _new_pool(self, pages: int) -> torch.Tensor:
        s = self.shape
        return torch.zeros(s.num_layers, pages, self.page_tokens, s.num_kv_heads, s.head_dim, dtype=s.dtype,
                           device=s.device)

    def _grow(self, tokens: int, sessions: int) -> None:
        """Double the budget and the sessions until `tokens` and `sessions` fit (a growable pool); held
        pages keep their ids."""
        while self.budget_tokens < tokens:
            self.budget_tokens *= 2
        while self.max_sessions < sessions:
            self.max_sessions *= 2
        new_size = self.pages_for(self.budget_tokens) + self.max_sessions + self.pages_for(self.spare_tokens)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = self._new_pool(new_size)
            new[:, : self.num_pages] = old
            setattr(self, name, new)
        self._free = list(range(new_size - 1, self.num_pages - 1, -1)) + self._free
        self.num_pages = new_size
