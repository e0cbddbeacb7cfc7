"""Decode and verify forwards of the target replayed from CUDA graphs (nano-vllm's model runner idea).

A step whose items are all decodes or whole-block verifies (no prefill chunk) is padded to a bucket of
token counts (1, 2, 4, 8, then every 16) and replayed from the graph captured for that bucket: one
launch instead of thousands. Everything the forward reads lives in static buffers filled before the
replay (token ids, positions, write slots, and Flash Attention's cu_seq_q / cu_seq_k / seqused_k /
block table for `max_sessions` sessions plus one padding session), so the captured kernels never see
a new pointer or a host value. Padding tokens belong to the padding session, whose keys/values go to
scratch pages reserved for it; unused session rows attend to nothing (zero queries, zero keys).

CUDA only, and only with the `varlen` attention backend (the padded SDPA backend's shapes depend on the
sessions). Prefill chunks and anything larger than the largest bucket run eagerly.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .attention_backend import AttentionBackend

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .target import ForwardItem, TargetModel

PAD_SESSION = "__cuda_graph_padding__"


def token_buckets(most: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `most` (rounded up to 16)."""
    small = [b for b in (1, 2, 4, 8) if b < most]
    return small + list(range(16, -(-most // 16) * 16 + 1, 16))


@dataclass
class _StaticPlan:
    """What `VarlenPaged.attend` reads from a plan, as static buffers (max_q / max_k are bounds)."""

    varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]
    causal: bool = True


@dataclass
class _StaticBatch:
    """What `packed_attention` reads from a PackedBatch, as static buffers."""

    cache: BlockManager
    backend: AttentionBackend
    slots: torch.Tensor
    plan: _StaticPlan


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    features: torch.Tensor
    batch: _StaticBatch = field(repr=False)


class GraphRunner:
    """Captured forwards of one target on one pool, by token bucket; `run` replays the one that fits."""

    def __init__(self, target: TargetModel, cache: BlockManager, max_sessions: int, max_tokens: int) -> None:
        if target.device.type != "cuda" or target.attention.name != "varlen":
            raise ValueError("CUDA graphs need a CUDA target with the varlen attention backend")
        self.target, self.cache, self.max_sessions = target, cache, max_sessions
        self.buckets = token_buckets(max_tokens)
        device, most = target.device, self.buckets[-1]
        if cache.spare_tokens < most:
            raise ValueError(f"CUDA graphs: the cache has {cache.spare_tokens} spare tokens, the padding needs {most}")
        rows = max_sessions + 1  # the real sessions, then the padding session
        self.max_keys = target.max_positions
        width = cache.pages_for(self.max_keys)
        cache.reserve_spare(PAD_SESSION)
        self.pad_pages = cache.extend(PAD_SESSION, 0, most)
        self.input_ids = torch.zeros(most, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, most, dtype=torch.long, device=device)
        self.slots = torch.zeros(most, dtype=torch.long, device=device)
        self.cu_q = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.used_k = torch.zeros(rows, dtype=torch.int32, device=device)
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        for bucket in reversed(self.buckets):  # the largest first: the others reuse its memory
            self.graphs[bucket] = self._capture(bucket)

    def fits(self, items: list[ForwardItem]) -> bool:
        total = sum(len(i.token_ids) for i in items)
        return (0 < len(items) <= self.max_sessions and total <= self.buckets[-1]
                and not any(i.last_only for i in items))

    @torch.inference_mode()
    def run(self, items: list[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, V] and features [T, F] of every token of the items (views of static outputs,
        valid until the next replay). The caller checked `fits`."""
        total = sum(len(i.token_ids) for i in items)
        bucket = self.buckets[bisect_left(self.buckets, total)]
        self._fill(items, total, bucket)
        g = self.graphs[bucket]
        g.graph.replay()
        return g.logits[:total], g.features[:total]

    # -- buffers ----------------------------------------------------------------------------------

    def _fill(self, items: list[ForwardItem], total: int, bucket: int) -> None:
        ids, positions, slots, cu_q, cu_k, used, rows = [], [], [], [0], [0], [], []
        for item in items:
            n = len(item.token_ids)
            pages = self.cache.extend(item.session_id, item.start, n)
            ids += item.token_ids
            positions += range(item.start, item.start + n)
            slots += self.cache.slots(pages, item.start, n)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + item.start + n)
            used.append(item.start + n)
            rows.append(pages)
        pad = bucket - total
        ids += [0] * pad
        positions += range(pad)
        slots += self.cache.slots(self.pad_pages, 0, pad)
        empty = self.max_sessions - len(items)
        cu_q += [cu_q[-1]] * empty + [cu_q[-1] + pad]
        cu_k += [cu_k[-1]] * empty + [cu_k[-1] + pad]
        used += [0] * empty + [pad]
        width = self.table.shape[1]
        table = [p + [0] * (width - len(p)) for p in rows] + [[0] * width] * empty + \
                [self.pad_pages + [0] * (width - len(self.pad_pages))]
        self.input_ids[:bucket].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[0, :bucket].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.slots[:bucket].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.cu_q.copy_(torch.tensor(cu_q, dtype=torch.int32), non_blocking=True)
        self.cu_k.copy_(torch.tensor(cu_k, dtype=torch.int32), non_blocking=True)
        self.used_k.copy_(torch.tensor(used, dtype=torch.int32), non_blocking=True)
        self.table.copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)

    # -- capture ----------------------------------------------------------------------------------

    def _capture(self, bucket: int) -> _Graph:
        plan = _StaticPlan((self.cu_q, self.cu_k, self.used_k, self.table, bucket, self.max_keys))
        batch = _StaticBatch(self.cache, self.target.attention, self.slots[:bucket], plan)
        # A valid forward to warm up on and capture: the padding session holds every token.
        self._fill([], 0, bucket)
        forward = lambda: self.target.forward_static(self.input_ids[:bucket], self.positions[:, :bucket], batch)  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            logits, features = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return _Graph(graph, logits, features, batch)
