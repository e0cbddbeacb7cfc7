"""The target model: one packed forward prefills and verifies many sessions, returning logits and features."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from . import packed_attention
from .attention_backend import backend_for, page_tokens_for
from .block_manager import BlockManager, CacheShape
from .packed_attention import NO_MASK, PackedBatch

if TYPE_CHECKING:
    from .cuda_graphs import GraphRunner


@dataclass
class TargetOutput:
    """logits: [L, V] float32 for the kept positions; features: [L, n*H] selected hidden states."""

    logits: torch.Tensor
    features: torch.Tensor


@dataclass
class PackedOutput:
    """A packed forward's outputs for all items at once: logits [K, V] float32 of the kept rows, item i's
    at rows logit_starts[i] .. + logit_counts[i]; features [T, n*H] of every token, item i's from row
    offsets[i] (its token count long). Indexing gives one item's TargetOutput (views, no copies)."""

    logits: torch.Tensor
    features: torch.Tensor
    logit_starts: list[int]
    logit_counts: list[int]
    offsets: list[int]
    num_tokens: list[int]

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> TargetOutput:
        a, o = self.logit_starts[i], self.offsets[i]
        return TargetOutput(self.logits[a : a + self.logit_counts[i]], self.features[o : o + self.num_tokens[i]])

    def __iter__(self) -> Iterator[TargetOutput]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class ForwardItem:
    """One session's part of a packed forward: `token_ids` at absolute positions start.., onto a cache
    holding exactly `start` positions; `last_only` keeps the logits of the last token only (prefill)."""

    session_id: str
    token_ids: tuple[int, ...]
    start: int
    last_only: bool = False


class TargetModel:
    """Wraps any Hugging Face causal LM whose attention goes through transformers' AttentionInterface.

    `layer_ids` are decoder-layer indices; the output of decoder layer i is `hidden_states[i + 1]`
    (index 0 is the embedding output). The model's attention is switched to `packed_attention`, which
    is plain SDPA unless a packed batch is passed, so the model still works elsewhere (`generate()`).
    """

    def __init__(self, model: PreTrainedModel, layer_ids: tuple[int, ...] = (), attention: str = "auto",
                 cuda_graphs: bool = True) -> None:
        self.model = model.eval()
        self.attention = backend_for(model.device, attention, model.dtype)
        self.cuda_graphs = cuda_graphs
        self.graphs: GraphRunner | None = None  # set by capture_graphs
        self.model.set_attn_implementation(packed_attention.IMPLEMENTATION)
        self.layer_ids = tuple(layer_ids)
        text = model.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_positions = getattr(text, "max_position_embeddings", None) or (1 << 30)
        self.cache_shape = CacheShape(
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            dtype=model.dtype,
            device=model.device,
        )

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def page_tokens(self) -> int:
        """Positions per KV page (what the attention backend reads best); reservations take whole pages."""
        return page_tokens_for(self.attention)

    def new_cache(self, budget_tokens: int, max_sessions: int = 1, spare_tokens: int = 0) -> BlockManager:
        """A paged KV pool for up to `max_sessions` sessions holding at most `budget_tokens` positions in all
        (plus `spare_tokens` outside the budget: CUDA graphs' padding)."""
        return BlockManager(self.cache_shape, budget_tokens, self.page_tokens, max_sessions, spare_tokens=spare_tokens)

    @property
    def can_use_graphs(self) -> bool:
        """Whether decode/verify steps can replay CUDA graphs here (CUDA, varlen backend, not switched off)."""
        return self.cuda_graphs and self.device.type == "cuda" and self.attention.name == "varlen"

    def capture_graphs(self, cache: BlockManager, max_sessions: int, max_tokens: int) -> None:
        """Capture decode/verify forwards on `cache` for up to `max_sessions` sessions and `max_tokens`
        tokens (cuda_graphs.py); the cache needs `max_tokens` spare tokens for the padding."""
        from .cuda_graphs import GraphRunner

        self.graphs = GraphRunner(self, cache, max_sessions, max_tokens)

    @torch.inference_mode()
    def forward(self, cache: BlockManager, items: list[ForwardItem]) -> PackedOutput:
        """One forward over every item's tokens, extending each session's cache; outputs in item order.

        Logits for every token of an item (or its last with last_only), features for every token.
        Decodes and verifies replay a CUDA graph when one was captured for this cache.
        """
        if self.graphs is not None and self.graphs.cache is cache and self.graphs.fits(items):
            logits, features = self.graphs.run(items)
            offsets, total = [], 0
            for item in items:
                offsets.append(total)
                total += len(item.token_ids)
            counts = [len(i.token_ids) for i in items]
            return PackedOutput(logits.float(), features, offsets, counts, offsets, counts)
        batch = PackedBatch(cache, self.attention, tuple(i.session_id for i in items), tuple(i.start for i in items),
                            tuple(len(i.token_ids) for i in items))
        ids = torch.tensor([t for i in items for t in i.token_ids], dtype=torch.long).to(self.device, non_blocking=True)
        keep, starts, counts = [], [], []
        for item, offset in zip(items, batch.offsets):
            n = len(item.token_ids)
            starts.append(len(keep))
            keep.extend([offset + n - 1] if item.last_only else range(offset, offset + n))
            counts.append(len(keep) - starts[-1])
        out = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=batch.positions(self.device),
            attention_mask=NO_MASK,
            use_cache=False,
            output_hidden_states=bool(self.layer_ids),
            logits_to_keep=torch.tensor(keep).to(self.device, non_blocking=True),
            dflash_batch=batch,
        )
        logits = out.logits[0].float()
        if self.layer_ids:
            features = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        else:
            features = ids.new_zeros((ids.shape[0], 0), dtype=torch.float32)
        return PackedOutput(logits, features, starts, counts, batch.offsets, list(batch.num_tokens))

    def forward_static(self, ids: torch.Tensor, positions: torch.Tensor,
                       batch: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward a CUDA graph captures: ids [T], positions [1, T], a batch of static buffers ->
        logits [T, V] and features [T, F] of every token (no host work, no host sync)."""
        out = self.model(input_ids=ids.unsqueeze(0), position_ids=positions, attention_mask=NO_MASK, use_cache=False,
                         output_hidden_states=bool(self.layer_ids), logits_to_keep=0, dflash_batch=batch)
        if self.layer_ids:
            features = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        else:
            features = ids.new_zeros((ids.shape[0], 0), dtype=torch.float32)
        return out.logits[0], features

    def forward_alone(self, token_ids: Iterable[int]) -> TargetOutput:
        """One sequence from position 0 on a throwaway cache: logits and features of every token."""
        ids = tuple(int(t) for t in token_ids)
        cache = self.new_cache(len(ids))
        cache.reserve("alone", len(ids))
        return self.forward(cache, [ForwardItem("alone", ids, 0)])[0]
