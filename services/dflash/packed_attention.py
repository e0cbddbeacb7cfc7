"""Ragged batches through any Hugging Face decoder: dense layers over all tokens, attention per session.

The target forward of a scheduler step packs every session's new tokens into one row [1, T] with
their absolute positions. Linear layers, norms and the MLP run once over all T tokens; attention,
the only part that mixes tokens, runs per session over that session's own cache (`KVCache`), so no
token ever sees another session's keys and nothing is padded to the longest context.

It plugs in through transformers' `AttentionInterface` under the name `ragged_sessions`: the model's
attention modules still compute queries, keys and values (q/k norms, RoPE at the given positions) and
hand them to `packed_attention`, which writes the new keys/values into the cache and attends. Without a
`dflash_batch` argument it is plain SDPA, so the same model object still works with `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .kv_cache import KVCache

IMPLEMENTATION = "ragged_sessions"  # not "*flash*": transformers would look for a flash kernel


@dataclass(frozen=True)
class PackedBatch:
    """Which tokens of the packed row belong to whom.

    Session i owns rows offsets[i] .. offsets[i] + num_tokens[i] of the row, at absolute positions
    starts[i] .. starts[i] + num_tokens[i] - 1; its cache holds positions [0, starts[i]) before the forward.
    """

    cache: KVCache
    session_ids: tuple[str, ...]
    starts: tuple[int, ...]
    num_tokens: tuple[int, ...]

    @cached_property  # read per layer and per session: computed once
    def offsets(self) -> list[int]:
        out, total = [], 0
        for n in self.num_tokens:
            out.append(total)
            total += n
        return out

    @cached_property  # the same for every layer: built once per forward
    def _masks(self) -> dict[tuple[int, int | None], torch.Tensor | None]:
        return {}

    def mask(self, i: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
        """Session i's causal mask (see `causal_mask`), shared by every layer of this forward."""
        key = (i, sliding_window)
        if key not in self._masks:
            self._masks[key] = causal_mask(self.starts[i], self.num_tokens[i], sliding_window, device)
        return self._masks[key]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def positions(self, device: torch.device) -> torch.Tensor:
        """Absolute positions of the packed row: [1, T]."""
        return torch.cat([torch.arange(s, s + n) for s, n in zip(self.starts, self.num_tokens)]).to(device).unsqueeze(0)


def causal_mask(start: int, n: int, sliding_window: int | None, device: torch.device) -> torch.Tensor | None:
    """Bool [n, start + n]: query start+i sees keys at positions <= start+i (within the window); None when
    every query sees every key (one query, no window)."""
    if n == 1 and sliding_window is None:
        return None
    q = torch.arange(start, start + n, device=device).unsqueeze(1)
    k = torch.arange(start + n, device=device).unsqueeze(0)
    mask = k <= q
    if sliding_window is not None:
        mask &= (q - k) < sliding_window
    return mask


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
    batch, layer, outputs = dflash_batch, module.layer_idx, []
    gqa = key.shape[1] != query.shape[1]
    for i, (sid, start, n, off) in enumerate(zip(batch.session_ids, batch.starts, batch.num_tokens, batch.offsets)):
        keys, values = batch.cache.write(layer, sid, start, key[0, :, off : off + n], value[0, :, off : off + n])
        mask = batch.mask(i, sliding_window, query.device)
        out = F.scaled_dot_product_attention(
            query[:, :, off : off + n], keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling,
            enable_gqa=gqa,
        )
        outputs.append(out[0].transpose(0, 1))  # [n, heads, d]
    return torch.cat(outputs).unsqueeze(0), None


# The dummy 4D mask that makes transformers' mask builders return at once (attention ignores it).
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)

AttentionInterface.register(IMPLEMENTATION, packed_attention)
# Plain (unpacked) calls to a model set to this implementation build the same masks SDPA gets.
ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)
