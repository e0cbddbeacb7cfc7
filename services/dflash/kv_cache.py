"""Key/value memory for many sessions at once: per-session buffers, a token budget, rollback by length.

One `KVCache` serves one model (the target, or a drafter's context cache). Each session owns, per
layer, one contiguous key buffer and one value buffer [kv_heads, capacity, head_dim]; attention
reads a view of its first `length` positions, so a step copies nothing but the new tokens' keys and
values. Buffers grow by whole pages (doubling, so a session is copied O(log n) times in its life,
never per step). Memory is accounted in tokens against a budget: a session reserves the most tokens
it can ever hold when it is admitted, so a running session never runs out and admission is the only
place where the budget can say no. Rolling back rejected draft tokens only lowers `length`: the
rejected positions are overwritten by the next round.
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


class _Slot:
    __slots__ = ("keys", "values", "length", "reserved")

    def __init__(self, reserved: int) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.length = 0
        self.reserved = reserved


class KVCache:
    """Per-session key/value buffers under a budget of `budget_tokens` cached positions."""

    def __init__(self, shape: CacheShape, budget_tokens: int, page_tokens: int = 64) -> None:
        if budget_tokens < 1:
            raise DFlashError(f"cache budget: {budget_tokens} tokens; give at least one")
        self.shape = shape
        self.budget_tokens = budget_tokens
        self.page_tokens = page_tokens
        self._slots: dict[str, _Slot] = {}
        self.reserved_tokens = 0

    # -- accounting -------------------------------------------------------------------------------

    def can_reserve(self, tokens: int) -> bool:
        return self.reserved_tokens + tokens <= self.budget_tokens

    def reserve(self, session_id: str, tokens: int) -> None:
        """Admit a session that may hold up to `tokens` positions; CacheFullError when they do not fit."""
        if session_id in self._slots:
            raise DFlashError(f"cache: session {session_id!r} already has a slot")
        if not self.can_reserve(tokens):
            raise CacheFullError(f"cache: {tokens} tokens do not fit; {self.budget_tokens - self.reserved_tokens} "
                                 f"of {self.budget_tokens} are free")
        self._slots[session_id] = _Slot(tokens)
        self.reserved_tokens += tokens

    def free(self, session_id: str) -> None:
        slot = self._slots.pop(session_id, None)
        if slot is not None:
            self.reserved_tokens -= slot.reserved

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._slots

    @property
    def num_sessions(self) -> int:
        return len(self._slots)

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by buffers now (at most reserved_tokens x bytes_per_token, rounded up to pages)."""
        return sum(k.numel() * k.element_size() * 2 for s in self._slots.values() for k in s.keys)

    # -- data -------------------------------------------------------------------------------------

    def length(self, session_id: str) -> int:
        return self._slots[session_id].length

    def crop(self, session_id: str, length: int) -> None:
        """Keep the first `length` positions (drop rejected draft tokens); never grows."""
        slot = self._slots[session_id]
        slot.length = min(slot.length, length)

    def write(
        self, layer: int, session_id: str, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [kv_heads, n, head_dim] at positions start..start+n-1 of the session and
        return views of its positions [0, start + n). `start` must not pass the session's length."""
        slot = self._slots[session_id]
        n = keys.shape[-2]
        end = start + n
        if start > slot.length:
            raise DFlashError(f"cache: session {session_id!r} holds {slot.length} positions, a write starts at {start}")
        if end > slot.reserved:
            raise DFlashError(f"cache: session {session_id!r} reserved {slot.reserved} positions, needs {end}")
        if layer == len(slot.keys):
            slot.keys.append(self._new_buffer(end, slot.reserved))
            slot.values.append(self._new_buffer(end, slot.reserved))
        elif slot.keys[layer].shape[-2] < end:
            slot.keys[layer] = self._grow(slot.keys[layer], end, slot.reserved)
            slot.values[layer] = self._grow(slot.values[layer], end, slot.reserved)
        k_buf, v_buf = slot.keys[layer], slot.values[layer]
        k_buf[:, start:end] = keys
        v_buf[:, start:end] = values
        if layer == 0:
            slot.length = end
        return k_buf[:, :end], v_buf[:, :end]

    def _capacity(self, needed: int, reserved: int) -> int:
        pages = -(-needed // self.page_tokens)
        return min(reserved, pages * self.page_tokens)

    def _new_buffer(self, needed: int, reserved: int) -> torch.Tensor:
        s = self.shape
        return torch.empty(s.num_kv_heads, self._capacity(needed, reserved), s.head_dim, dtype=s.dtype, device=s.device)

    def _grow(self, buffer: torch.Tensor, needed: int, reserved: int) -> torch.Tensor:
        new = self._new_buffer(max(needed, 2 * buffer.shape[-2]), reserved)
        new[:, : buffer.shape[-2]] = buffer
        return new
