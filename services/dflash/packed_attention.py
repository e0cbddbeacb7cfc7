"""Ragged batches through any Hugging Face decoder: dense layers over all tokens, one attention call per layer.

The target forward of a scheduler step packs every session's new tokens into one row [1, T] with
their absolute positions. Linear layers, norms and the MLP run once over all T tokens; attention, the
only part that mixes tokens, goes through the attention backend (attention_backend.py), which writes the
new keys/values into the paged pool (block_manager.py) and attends for every session at once, each over
its own pages only, so no token ever sees another session's keys.

It plugs in through transformers' `AttentionInterface` under the name `ragged_sessions`: the model's
attention modules still compute queries, keys and values (q/k norms, RoPE at the given positions) and
hand them to `packed_attention`. Without a `dflash_batch` argument it is plain SDPA, so the same model
object still works with `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .attention_backend import AttentionBackend, AttentionPlan, SessionSpan, write_kv
from .block_manager import BlockManager

IMPLEMENTATION = "ragged_sessions"  # not "*flash*": transformers would look for a flash kernel


@dataclass
class PackedBatch:
    """Which tokens of the packed row belong to whom, and where their keys/values go.

    Session i owns rows offsets[i] .. offsets[i] + num_tokens[i] of the row, at absolute positions
    starts[i] .. starts[i] + num_tokens[i] - 1; its cache holds positions [0, starts[i]) before the
    forward. Building it extends every session's block table (host work, once per forward).
    """

    cache: BlockManager
    backend: AttentionBackend
    session_ids: tuple[str, ...]
    starts: tuple[int, ...]
    num_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        spans, slots = [], []
        for sid, start, n in zip(self.session_ids, self.starts, self.num_tokens):
            pages = self.cache.extend(sid, start, n)
            slots += self.cache.slots(pages, start, n)
            spans.append(SessionSpan(tuple(pages), start, n, start + n))
        device = self.cache.shape.device
        self.plan = AttentionPlan(spans, self.cache.page_tokens, causal=True, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)

    @cached_property
    def offsets(self) -> list[int]:
        out, total = [], 0
        for n in self.num_tokens:
            out.append(total)
            total += n
        return out

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def positions(self, device: torch.device) -> torch.Tensor:
        """Absolute positions of the packed row: [1, T]."""
        rows = [p for s, n in zip(self.starts, self.num_tokens) for p in range(s, s + n)]
        return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True).unsqueeze(0)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    dflash_batch: PackedBatch | None = None,
    **kwargs: Any,  # the rest of what the model's attention passes (is_causal, position_ids, ...), for SDPA
) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] of the packed row -> ([1, T, heads, d], None)."""
    if dflash_batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    batch = dflash_batch
    keys, values = batch.cache.keys[module.layer_idx], batch.cache.values[module.layer_idx]
    write_kv(keys, values, key[0].transpose(0, 1), value[0].transpose(0, 1), batch.slots)
    out = batch.backend.attend(query[0], keys, values, batch.plan, scaling, sliding_window)
    return out.unsqueeze(0), None


# The dummy 4D mask that makes transformers' mask builders return at once (attention ignores it).
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)

AttentionInterface.register(IMPLEMENTATION, packed_attention)
# Plain (unpacked) calls to a model set to this implementation build the same masks SDPA gets.
ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)
