"""Attention over the paged KV pool: one call per layer for every session of a step.

A forward's sessions are described once (`AttentionPlan`, built on the host before the model runs);
every layer then writes its new keys/values into the pool at the plan's slots and attends, with a
fixed number of operators whatever the number of sessions. Each session's query j sees the keys at
positions <= limit (its own position for a causal target; the whole block for the drafter's
bidirectional block) and, in a sliding-window layer, only those less than `window` behind it.

Backends, chosen by device (`backend_for`):
  padded_sdpa  CPU. Gathers the step's pages into [B, kv_heads, P * page, d], pads queries to the
               longest session and runs one masked SDPA. Measured here against the loop (docs/service.md).
  varlen       CUDA. torch's `varlen_attn` (Flash Attention) reads the pool through the block table:
               nothing gathered, nothing padded.
  loop         The reference: one SDPA per session over its own pages. Tests compare against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from .errors import DFlashError

# A prefill chunk longer than this is attended on its own: padding every decode to its length would
# cost more than the extra call.
PAD_QUERIES_UP_TO = 32


@dataclass(frozen=True)
class SessionSpan:
    """One session's part of a forward: its block table, `num_queries` query rows at rows
    first_query .. first_query + num_queries - 1 of its pages, and `num_keys` rows to read (after this
    forward's writes). Positions count from the session's row 0: attention needs only distances."""

    pages: tuple[int, ...]
    first_query: int
    num_queries: int
    num_keys: int


class AttentionPlan:
    """The step's sessions as tensors every layer reuses (built once per forward, on the host)."""

    def __init__(self, spans: list[SessionSpan], page_tokens: int, causal: bool, device: torch.device) -> None:
        self.spans = spans
        self.page_tokens = page_tokens
        self.causal = causal
        self.device = device
        self.num_queries = sum(s.num_queries for s in spans)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    # -- padded groups (padded_sdpa) ----------------------------------------------------------------

    @cached_property
    def groups(self) -> list[_PaddedGroup]:
        """Sessions with short query runs padded together; each long prefill chunk on its own."""
        short, groups, row = [], [], 0
        for span in self.spans:
            if span.num_queries <= PAD_QUERIES_UP_TO:
                short.append((row, span))
            else:
                groups.append(_PaddedGroup(self, [(row, span)]))
            row += span.num_queries
        if short:
            groups.insert(0, _PaddedGroup(self, short))
        return groups

    # -- varlen (CUDA) ------------------------------------------------------------------------------

    @cached_property
    def varlen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
        """cu_seq_q [B+1], cu_seq_k [B+1], seqused_k [B], block_table [B, P] (all int32), max_q, max_k."""
        cu_q, cu_k = [0], [0]
        for s in self.spans:
            cu_q.append(cu_q[-1] + s.num_queries)
            cu_k.append(cu_k[-1] + s.num_keys)
        width = max(len(s.pages) for s in self.spans)
        table = [list(s.pages) + [0] * (width - len(s.pages)) for s in self.spans]
        return (self._tensor(cu_q, torch.int32), self._tensor(cu_k, torch.int32),
                self._tensor([s.num_keys for s in self.spans], torch.int32),
                torch.tensor(table, dtype=torch.int32).to(self.device, non_blocking=True),
                max(s.num_queries for s in self.spans), max(s.num_keys for s in self.spans))


class _PaddedGroup:
    """B sessions padded to Q queries and P pages: the index tensors and the mask of one SDPA call."""

    def __init__(self, plan: AttentionPlan, members: list[tuple[int, SessionSpan]]) -> None:
        size = plan.page_tokens
        self.batch = len(members)
        self.queries = max(s.num_queries for _, s in members)
        self.pages = max(len(s.pages) for _, s in members)
        q_rows, pages, limits, q_pos, out_rows = [], [], [], [], []
        for b, (row, s) in enumerate(members):
            q_rows += [row + j for j in range(s.num_queries)] + [row] * (self.queries - s.num_queries)
            pages += list(s.pages) + [s.pages[0]] * (self.pages - len(s.pages))
            for j in range(self.queries):
                p = s.first_query + min(j, s.num_queries - 1)
                q_pos.append(p)
                limits.append(p if plan.causal else s.num_keys - 1)
            out_rows += [b * self.queries + j for j in range(s.num_queries)]
        # Rows of the packed queries this group holds, in packed order: contiguous and unpadded when
        # the group is the whole forward with equal query runs (decode, whole-block verify).
        self.identity = (plan.num_queries == len(out_rows) == self.batch * self.queries)
        self.q_rows = plan._tensor(q_rows)
        self.packed_rows = plan._tensor(sum(([row + j for j in range(s.num_queries)] for row, s in members), []))
        self.out_rows = plan._tensor(out_rows)
        self.page_ids = plan._tensor(pages)
        # A lone session whose pages are consecutive in the pool (a fresh pool's usual case): its keys and
        # values are read as a slice of the pool, a view, instead of gathered (a copy per layer and step).
        consecutive = self.batch == 1 and bool(pages) and pages == list(range(pages[0], pages[0] + len(pages)))
        self.page_range = (pages[0], pages[0] + len(pages)) if consecutive else None
        keys = torch.arange(self.pages * size, device=plan.device)  # pool row -> position from row 0
        limit = plan._tensor(limits).view(self.batch, 1, self.queries, 1)
        self.mask = keys.view(1, 1, 1, -1) <= limit
        self._q_pos = plan._tensor(q_pos).view(self.batch, 1, self.queries, 1)
        self._k_pos = keys.view(1, 1, 1, -1)
        self._windows: dict[int, torch.Tensor] = {}

    def window_mask(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self._windows:
            self._windows[window] = self.mask & ((self._q_pos - self._k_pos) < window)
        return self._windows[window]


class PaddedSDPA:
    """CPU: gather each group's pages, pad its queries, one masked SDPA per group (one in a decode step)."""

    name = "padded_sdpa"

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
               scale: float | None, window: int | None) -> torch.Tensor:
        """query [H, T, d] packed; keys/values [pages, page, kv_heads, d] (one layer's pool) -> [T, H, d]."""
        heads, total, dim = query.shape
        out = None
        for group in plan.groups:
            b, q, width = group.batch, group.queries, group.pages * plan.page_tokens
            qg = query if group.identity else query.index_select(1, group.q_rows)
            qg = qg.reshape(heads, b, q, dim).transpose(0, 1)
            if group.page_range is not None:
                k, v = keys[slice(*group.page_range)], values[slice(*group.page_range)]
            else:
                k, v = keys.index_select(0, group.page_ids), values.index_select(0, group.page_ids)
            k = k.view(b, width, *keys.shape[2:]).transpose(1, 2)
            v = v.view(b, width, *values.shape[2:]).transpose(1, 2)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.window_mask(window), scale=scale,
                                               enable_gqa=k.shape[1] != heads)
            o = o.transpose(1, 2).reshape(b * q, heads, dim)
            if group.identity:
                return o
            if out is None:
                out = query.new_empty((total, heads, dim))
            out.index_copy_(0, group.packed_rows, o.index_select(0, group.out_rows))
        return out


class SessionLoop:
    """The reference: each session's pages gathered and attended on their own (operators grow with B)."""

    name = "loop"

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
               scale: float | None, window: int | None) -> torch.Tensor:
        outputs, row = [], 0
        for s in plan.spans:
            n = s.num_queries
            pages = torch.tensor(s.pages, device=keys.device)
            k = keys.index_select(0, pages).flatten(0, 1)[: s.num_keys].transpose(0, 1).unsqueeze(0)
            v = values.index_select(0, pages).flatten(0, 1)[: s.num_keys].transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(s.first_query, s.first_query + n, device=keys.device).unsqueeze(1)
            k_pos = torch.arange(s.num_keys, device=keys.device).unsqueeze(0)
            mask = (k_pos <= q_pos) if plan.causal else None
            if window is not None:
                near = (q_pos - k_pos) < window
                mask = near if mask is None else mask & near
            o = F.scaled_dot_product_attention(query[:, row : row + n].unsqueeze(0), k, v,
                                               attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != query.shape[0])
            outputs.append(o[0].transpose(0, 1))
            row += n
        return torch.cat(outputs)


class VarlenPaged:
    """CUDA: Flash Attention's varlen kernel reads the pool through the block table (torch >= 2.12)."""

    name = "varlen"

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
               scale: float | None, window: int | None) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        cu_q, cu_k, used_k, table, max_q, max_k = plan.varlen
        if plan.causal:
            size = (window - 1, 0) if window is not None else (-1, 0)
        else:
            size = (window - 1, -1) if window is not None else (-1, -1)
        return varlen_attn(query.transpose(0, 1), keys, values, cu_q, cu_k, max_q, max_k, scale=scale,
                           window_size=size, enable_gqa=keys.shape[2] != query.shape[0], seqused_k=used_k,
                           block_table=table)


class AttentionBackend(Protocol):
    """What a backend does for one layer: query [H, T, d] (the packed row's queries), that layer's pool
    keys/values [pages, page, kv_heads, d] already holding this forward's writes -> output [T, H, d]."""

    name: str

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
               scale: float | None, window: int | None) -> torch.Tensor: ...


BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (PaddedSDPA, SessionLoop, VarlenPaged)}


def backend_for(device: torch.device, name: str = "auto", dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """The backend `name`, or for "auto" the one measured best on `device`'s type (Flash Attention on
    CUDA in half precision; padded SDPA otherwise, fp32 on CUDA included)."""
    half = dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        name = "varlen" if device.type == "cuda" and half else "padded_sdpa"
    if name not in BACKENDS:
        raise DFlashError(f"attention backend: {name!r} is not one of auto, {', '.join(BACKENDS)}")
    if name == "varlen" and (device.type != "cuda" or not half):
        raise DFlashError(f"attention backend: 'varlen' runs on CUDA in float16/bfloat16 only, not {device.type} "
                          f"{str(dtype).removeprefix('torch.')}")
    return BACKENDS[name]()


def page_tokens_for(backend: AttentionBackend) -> int:
    """Page size the backend wants: Flash Attention's paged KV needs pages of 256 tokens."""
    return 256 if backend.name == "varlen" else 16


def write_kv(keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, d] at flat pool slots [T] of one layer's pool
    [pages, page, kv_heads, d] (in place: two operators whatever T)."""
    keys.view(-1, *keys.shape[2:]).index_copy_(0, slots, new_keys)
    values.view(-1, *values.shape[2:]).index_copy_(0, slots, new_values)
