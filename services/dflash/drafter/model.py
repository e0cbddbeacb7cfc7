"""The DFlash drafter: Qwen3-style layers whose keys/values start with the target's fused features.

Parameter names match the public checkpoint format (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`, ...). The drafter owns no embedding and no LM head: callers embed
block tokens with the target's `embed_tokens` and read logits through the target's `lm_head`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from ..attention_backend import AttentionBackend, AttentionPlan, SessionSpan, write_kv
from ..block_manager import BlockManager
from .config import DFlashConfig

_NOT_QWEN3_KEYS = ("architectures", "auto_map", "dflash_config", "block_size", "num_target_layers", "model_type")


class DraftCache:
    """Keys/values of the context features the drafter has seen, per layer: [1, kv_heads, n, head_dim].

    Only context (target features of committed positions) is kept; block keys/values live for one
    forward. `length` is the number of context positions held.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=-2)
            value = torch.cat([self.values[layer], value], dim=-2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


@dataclass
class PackedDraft:
    """Many sessions' drafter inputs in one forward, in session order.

    Session i brings num_context[i] new context rows (absolute positions from first_positions[i] +
    cache_starts[i]) onto a cache holding cache_starts[i] rows of it, and a block of block_sizes[i]
    tokens right after them. `cache` (a paged pool) holds every session's context keys/values, indexed
    from the session's first position (0 unless its context was rebuilt from a window). Building it
    extends the block tables by the new context and the block (host work, once per forward); the block's
    rows are for this forward only and are cropped afterwards.
    """

    cache: BlockManager
    backend: AttentionBackend
    session_ids: tuple[str, ...]
    first_positions: tuple[int, ...]
    cache_starts: tuple[int, ...]
    num_context: tuple[int, ...]
    block_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        spans, ctx_slots, blk_slots, ctx_pos, blk_pos = [], [], [], [], []
        for sid, first, at, nc, nb in zip(self.session_ids, self.first_positions, self.cache_starts,
                                          self.num_context, self.block_sizes):
            pages = self.cache.extend(sid, at, nc + nb)
            ctx_slots += self.cache.slots(pages, at, nc)
            blk_slots += self.cache.slots(pages, at + nc, nb)
            ctx_pos += range(first + at, first + at + nc)
            blk_pos += range(first + at + nc, first + at + nc + nb)
            spans.append(SessionSpan(tuple(pages), at + nc, nb, at + nc + nb))
        device = self.cache.shape.device
        self.plan = AttentionPlan(spans, self.cache.page_tokens, causal=False, device=device)
        # Keys/values are projected for [every session's context | every block] (DFlashAttention._qkv).
        self.kv_slots, self.kv_positions = _host(ctx_slots + blk_slots, device), _host(ctx_pos + blk_pos, device)

    @cached_property
    def blk_offsets(self) -> list[int]:
        return _offsets(self.block_sizes)

    def crop_blocks(self) -> None:
        """Drop the blocks' rows: only context stays cached."""
        for sid, at, nc in zip(self.session_ids, self.cache_starts, self.num_context):
            self.cache.crop(sid, at + nc)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, n, d] at cos/sin [B, n, d] (transformers' apply_rotary_pos_emb,
    for one tensor)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _host(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _offsets(counts: Iterable[int]) -> list[int]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context features | block], non-causal."""

    def __init__(self, config: DFlashConfig, qwen3: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: nn.Module | None) -> torch.Tensor:
        out = proj(x).view(*x.shape[:-1], -1, self.head_dim)
        if norm is not None:
            out = norm(out)
        return out.transpose(1, 2)

    def _qkv(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries of the block [B, heads, n_block, d]; keys and values of [context | block] [B, kv_heads,
        n_ctx + n_block, d], projected as one sequence, one matmul each (as the reference drafter and
        transformers' do). cos/sin cover [context | block] positions."""
        kv_in = torch.cat([context, hidden], dim=1)
        q = self._heads(hidden, self.q_proj, self.q_norm)
        k = self._heads(kv_in, self.k_proj, self.k_norm)
        v = self._heads(kv_in, self.v_proj, None)
        n_ctx = context.shape[1]
        return _rope(q, cos[:, n_ctx:], sin[:, n_ctx:]), _rope(k, cos, sin), v

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | BlockMask | None,
        cache: DraftCache | None,
    ) -> torch.Tensor:
        n_ctx = context.shape[1]
        cos, sin = rope  # [B, n_ctx + n_block, head_dim], context positions first
        q, k, v = self._qkv(hidden, context, cos, sin)
        k_ctx, v_ctx = k[:, :, :n_ctx], v[:, :, :n_ctx]
        if cache is not None:
            k_ctx, v_ctx = cache.append(self.layer_idx, k_ctx, v_ctx)
            k = torch.cat([k_ctx, k[:, :, n_ctx:]], dim=2)
            v = torch.cat([v_ctx, v[:, :, n_ctx:]], dim=2)
        gqa = self.num_kv_heads != self.num_heads
        if isinstance(mask, BlockMask):
            # Under autocast q/k leave their RMSNorm in float32 while v is bf16; SDPA is on autocast's cast
            # list, flex attention is not, and older releases reject mixed dtypes.
            device = q.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else v.dtype
            out = _flex_attention(q.device)(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=mask, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:-1], -1))

    def forward_packed(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedDraft,
    ) -> torch.Tensor:
        """hidden [1, Tq, H] (all sessions' blocks), context [1, Tc, H] (their new context rows).

        Every session's new context keys/values and its block's are written into its pages; one
        attention call then lets each block see its session's whole context and itself (the block rows
        are dropped after the forward by `PackedDraft.crop_blocks`).
        """
        q, k, v = self._qkv(hidden, context, *rope)
        keys, values = batch.cache.keys[self.layer_idx], batch.cache.values[self.layer_idx]
        write_kv(keys, values, k[0].transpose(0, 1), v[0].transpose(0, 1), batch.kv_slots)
        out = batch.backend.attend(q[0], keys, values, batch.plan, None, self.sliding_window)
        return self.o_proj(out.reshape(1, out.shape[0], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, qwen3: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, qwen3, layer_idx)
        self.mlp = Qwen3MLP(qwen3)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | BlockMask | None,
        cache: DraftCache | None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope, mask, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_packed(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: PackedDraft,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn.forward_packed(self.input_layernorm(hidden), context, rope, batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(nn.Module):
    """The drafter network. One forward drafts every block position at once."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        qwen3 = qwen3_config(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, qwen3, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache | None = None,
        attention_mask: torch.Tensor | BlockMask | None = None,
    ) -> torch.Tensor:
        """Draft hidden states for the block tokens.

        noise_embedding: [B, Lq, H], the target's embedding of [anchor token, MASK, ...] per block.
        target_hidden: [B, Lc, n*H], the selected target layers' outputs, concatenated, for NEW context
            positions (appended to `cache` when one is given).
        position_ids: [B, C + Lc + Lq] absolute positions of cached context, new context, then block,
            or [B, Lc + Lq] when no cache is given.
        attention_mask: optional bool [B, 1, Lq, C + Lc + Lq], True where a query may look (training), or
            that mask as a flex-attention BlockMask (only for drafters without sliding-window layers).
        Returns [B, Lq, H], normalised; apply the target's lm_head to get logits.
        """
        context = self.hidden_norm(self.fc(target_hidden))
        cached = cache.length if cache is not None else 0
        rope = self.rotary_emb(noise_embedding, position_ids[:, cached:])
        masks = self._masks(position_ids, noise_embedding.shape[1], attention_mask)
        hidden = noise_embedding
        for layer in self.layers:
            hidden = layer(hidden, context, rope, masks[layer.self_attn.sliding_window], cache)
        return self.norm(hidden)

    def forward_packed(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                       batch: PackedDraft) -> torch.Tensor:
        """Draft hidden states for the blocks of many sessions in one pass (inference only).

        noise_embedding: [Tq, H], every session's block embedded, packed in session order.
        target_hidden: [Tc, n*H], every session's NEW context features, packed in session order.
        Returns [Tq, H], normalised. Each session's context cache (batch.cache) grows by its new rows.
        """
        context = self.hidden_norm(self.fc(target_hidden)).unsqueeze(0)
        hidden = noise_embedding.unsqueeze(0)
        rope = self.rotary_emb(hidden, batch.kv_positions.unsqueeze(0))
        for layer in self.layers:
            hidden = layer.forward_packed(hidden, context, rope, batch)
        batch.crop_blocks()
        return self.norm(hidden)[0]

    @property
    def has_sliding_window(self) -> bool:
        return any(layer.self_attn.sliding_window is not None for layer in self.layers)

    def _masks(
        self, position_ids: torch.Tensor, num_queries: int, attention_mask: torch.Tensor | BlockMask | None
    ) -> dict[int | None, torch.Tensor | BlockMask | None]:
        masks: dict[int | None, torch.Tensor | BlockMask | None] = {None: attention_mask}
        if isinstance(attention_mask, BlockMask) and self.has_sliding_window:
            raise ValueError("a BlockMask cannot be combined with sliding-window layers; pass a dense mask")
        for window in {layer.self_attn.sliding_window for layer in self.layers} - {None}:
            q_pos = position_ids[:, -num_queries:, None]
            near = (q_pos - position_ids[:, None, :]) < window
            near = near[:, None]
            masks[window] = near if attention_mask is None else (near & attention_mask)
        return masks


_COMPILED_FLEX: Callable[..., torch.Tensor] | None = None


def _flex_attention(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled on CUDA (where it skips masked-out tiles); eager elsewhere, which computes
    the same result densely (used by the CPU tests that check the sparse path against the dense one)."""
    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)  # dynamic shapes after the first new length
    return _COMPILED_FLEX


def qwen3_config(config: DFlashConfig) -> Qwen3Config:
    """A transformers Qwen3Config for the shared pieces (RoPE variants, MLP activation)."""
    kwargs = {k: v for k, v in config.raw.items() if k not in _NOT_QWEN3_KEYS}
    kwargs.setdefault("head_dim", config.head_dim)
    kwargs.setdefault("hidden_act", "silu")
    return Qwen3Config(**kwargs)
