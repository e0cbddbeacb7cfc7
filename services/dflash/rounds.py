"""The pure pieces of one speculative round: make the block, accept against the posterior, commit.

No models and no I/O here: tensors and lists in, tensors and lists out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def make_block(last_token: int, block_size: int, mask_token_id: int) -> torch.Tensor:
    """The drafter's input: [last committed token, MASK x (block_size - 1)] as a LongTensor [block_size]."""
    block = torch.full((block_size,), mask_token_id, dtype=torch.long)
    block[0] = last_token
    return block


def confident_length(top_probs: Sequence[float], threshold: float) -> int:
    """How many leading proposals to keep: while the product of the drafter's top-token probabilities
    stays >= threshold, at least one (a draft of none would make the round a plain target step).

    top_probs: [n] the drafter's probability of each proposed token (host floats). The product
    estimates the chance that the target accepts every proposal up to there; cutting where it is small
    saves verifying tokens that would mostly be rejected. threshold 0 keeps all n.
    """
    n = len(top_probs)
    if threshold <= 0.0 or n == 0:
        return n
    running, kept = 1.0, 0
    for p in top_probs:
        running *= float(p)  # in double precision, as a cumulative product
        if running < threshold:
            break
        kept += 1
    return max(1, kept)


def accept_length(draft: Sequence[int], posterior: Sequence[int]) -> int:
    """Number of draft tokens the target agrees with.

    draft: [B-1] proposed tokens for positions start+1 .. start+B-1.
    posterior: [B] the target's own choice at positions start+1 .. start+B, given the block.
    Draft token i is accepted while every draft token up to i equals the target's choice there;
    since the draft is deterministic, this keeps the target's distribution exactly.
    (Host lists in the engine, one per session from one device->host copy per step.)
    """
    n = 0
    for proposed, chosen in zip(draft, posterior):
        if int(proposed) != int(chosen):
            break
        n += 1
    return n


def committed_tokens(draft: Sequence[int], posterior: Sequence[int], accepted: int) -> list[int]:
    """The accepted draft tokens plus the target's token at the first mismatch (the bonus token)."""
    return [int(t) for t in draft[:accepted]] + [int(posterior[accepted])]


@dataclass(frozen=True)
class Cut:
    """Where to stop inside newly committed tokens: keep `tokens`; `finish_reason` None means go on."""

    tokens: list[int]
    finish_reason: str | None


def cut_at_stop(new_tokens: list[int], stop_token_ids: frozenset[int], budget: int) -> Cut:
    """Apply stop token ids (kept, as Hugging Face does) and the remaining token budget.

    budget: how many more tokens may be emitted (max_new_tokens minus those already emitted).
    """
    for i, token in enumerate(new_tokens[:budget]):
        if token in stop_token_ids:
            return Cut(new_tokens[: i + 1], "stop")
    if len(new_tokens) >= budget:
        return Cut(new_tokens[:budget], "length")
    return Cut(list(new_tokens), None)
