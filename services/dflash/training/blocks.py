"""Training blocks: random anchors, block inputs, same-position labels, loss weights, the block-sparse mask.

Pure functions over tensors. One sequence of S tokens yields A blocks of `block_size` tokens each, all
drafted in ONE drafter forward. The drafter's keys are laid out as

    [context features of positions 0..S-1 | block 0 tokens | block 1 tokens | ... | block A-1 tokens]

and block j (anchor a_j) may look at context positions STRICTLY before a_j (the anchor token itself
enters only through the block's slot 0, exactly as at inference where the last committed token has
not been through the target yet) and at all tokens of its own block (bidirectional), never at other
blocks. Slot k of block j sits at position a_j + k and predicts the token AT that position (no shift).

Anchor rule: an anchor is a response token followed by at least one response token. At inference
the anchor is always a token the target generated (the first one comes from prefill), and a block
whose slot 1 has no label teaches nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

IGNORE = -100

# (block size, gamma) points from the paper; other block sizes interpolate (and extrapolate) linearly.
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))


@dataclass(frozen=True)
class Blocks:
    """The drafter's inputs for one batch of sequences.

    token_ids:  [B, A*Bs] anchor token then mask_token_id, block after block.
    positions:  [B, A*Bs] absolute positions anchor..anchor+Bs-1.
    labels:     [B, A, Bs] token ids to predict, IGNORE where no loss (slot 0, past the end, not response).
    teacher_positions: [B, A, Bs] the sequence position whose target logits predict each label
                (label position - 1); only meaningful where labels != IGNORE.
    attention_mask: [B, 1, A*Bs, S + A*Bs] bool, True where a block token may look; or the same mask as
                a flex-attention BlockMask (sparse: its cost grows linearly with the number of anchors).
    valid:      [B, A] which anchors are real (rows with fewer eligible anchors are padded).
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    teacher_positions: torch.Tensor
    attention_mask: torch.Tensor | BlockMask
    valid: torch.Tensor


def default_gamma(block_size: int) -> float:
    """Decay of the loss weights: 7 for block 16, 5 for block 10, 4 for block 8, piecewise linear between."""
    points = _GAMMA_POINTS
    if block_size <= points[0][0]:
        (b0, g0), (b1, g1) = points[0], points[1]
    elif block_size >= points[-1][0]:
        (b0, g0), (b1, g1) = points[-2], points[-1]
    else:
        i = next(i for i in range(1, len(points)) if block_size <= points[i][0])
        (b0, g0), (b1, g1) = points[i - 1], points[i]
    return max(0.5, g0 + (g1 - g0) * (block_size - b0) / (b1 - b0))


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size] float: 0 for slot 0 (the anchor, given), exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: response tokens whose next token is also a response token."""
    mask = loss_mask.bool()
    out = torch.zeros_like(mask)
    out[:, :-1] = mask[:, :-1] & mask[:, 1:]
    return out


def sample_anchors(
    loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick up to `max_anchors` distinct anchors per row among eligible positions: uniformly, or with
    probabilities proportional to `weights` [B, S] (> 0), drawn without replacement (Efraimidis-Spirakis:
    the largest keys u ** (1 / w); w = 1 everywhere is exactly the uniform draw).

    Returns (anchors [B, A] long, sorted ascending per row; valid [B, A] bool), A = min(max_anchors,
    most eligible positions in any row). Padded entries have anchor 0 and valid False. Draws exactly
    one `torch.rand(B, S)` from `generator`, so the stream is reproducible and resumable.
    """
    eligible = eligible_anchors(loss_mask)
    scores = torch.rand(eligible.shape, generator=generator, device=generator.device)
    if weights is not None:
        # log(u) / w orders as u ** (1 / w) does, without underflow when w is tiny; log on the generator's
        # device, where it is strictly increasing over torch.rand's values, so w = 1 is the uniform order
        scores = scores.clamp(min=1e-30).log().to(loss_mask.device) / weights.to(loss_mask.device).float().clamp(
            min=1e-6)
    scores = scores.to(loss_mask.device)
    scores = scores.masked_fill(~eligible, -math.inf)
    num = int(min(max_anchors, int(eligible.sum(dim=1).max().item()) if eligible.numel() else 0))
    num = max(num, 1)  # keep shapes non-empty; a row with nothing eligible gets one invalid anchor
    top, idx = scores.topk(num, dim=1)
    valid = top > -math.inf
    anchors = torch.where(valid, idx, torch.full_like(idx, torch.iinfo(torch.long).max))
    anchors, order = anchors.sort(dim=1)
    valid = valid.gather(1, order)
    anchors = anchors.masked_fill(~valid, 0)
    return anchors, valid


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    sparse_mask: bool = False,
) -> Blocks:
    """Build the drafter's block inputs, labels and attention mask for sequences [B, S].

    sparse_mask: the mask as a flex-attention BlockMask instead of a dense bool tensor.
    """
    batch, seq_len = input_ids.shape
    offsets = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + offsets  # [B, A, Bs]

    token_ids = torch.full_like(pos, mask_token_id)
    token_ids[:, :, 0] = input_ids.gather(1, anchors)

    inside = pos < seq_len
    safe = pos.clamp(max=seq_len - 1).view(batch, -1)
    target_tokens = input_ids.gather(1, safe).view_as(pos)
    is_response = loss_mask.bool().gather(1, safe).view_as(pos)
    has_label = inside & is_response & valid[:, :, None] & (offsets > 0)
    labels = torch.where(has_label, target_tokens, torch.full_like(pos, IGNORE))

    return Blocks(
        token_ids=token_ids.view(batch, -1),
        positions=pos.view(batch, -1),
        labels=labels,
        teacher_positions=(pos - 1).clamp(min=0, max=seq_len - 1),
        attention_mask=(block_sparse_mask if sparse_mask else block_attention_mask)(anchors, seq_len, block_size),
        valid=valid,
    )


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B, 1, A*Bs, S + A*Bs] bool over keys [context 0..S-1 | all blocks].

    Block j: context c visible iff c < anchor_j (strictly before); block keys visible iff same block.
    Every query row sees at least its own block, so no row is fully masked (no NaN in softmax).
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    ctx = torch.arange(seq_len, device=device)
    context = ctx[None, None, :] < anchors[:, :, None]  # [B, A, S]
    context = context[:, :, None, :].expand(batch, num_anchors, block_size, seq_len)
    block_of = torch.arange(num_anchors * block_size, device=device) // block_size
    same = block_of[:, None] == block_of[None, :]  # [A*Bs, A*Bs]
    mask = torch.cat(
        [context.reshape(batch, num_anchors * block_size, seq_len), same.expand(batch, -1, -1)], dim=2
    )
    return mask[:, None]


def block_sparse_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> BlockMask:
    """`block_attention_mask` as a flex-attention BlockMask, for the same key layout.

    Attention under the dense mask costs (A*Bs) x (S + A*Bs) scores per sequence and head: quadratic in
    the number of anchors (the paper's 512 anchors on a 4k-token sequence: 100M per sequence and head).
    The BlockMask lets compiled flex attention skip every tile with nothing visible, so a block costs
    only its context and its own block. Building the BlockMask still evaluates the mask once per step.
    """
    batch, num_anchors = anchors.shape

    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block = q // block_size
        return torch.where(kv < seq_len, kv < anchors[b, block], (kv - seq_len) // block_size == block)

    return create_block_mask(visible, batch, None, num_anchors * block_size, seq_len + num_anchors * block_size,
                             device=anchors.device)


def block_accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot correct and labelled counts ([Bs] each) and the accepted length of every full block.

    predictions, labels: [B, A, Bs]. A block's accepted length counts its leading correct slots
    1..Bs-1 plus the bonus token, as tau does; only blocks whose every slot 1..Bs-1 has a label count.
    """
    labelled = labels != IGNORE
    correct = (predictions == labels) & labelled
    per_slot_correct = correct.sum(dim=(0, 1))
    per_slot_labelled = labelled.sum(dim=(0, 1))
    full = labelled[..., 1:].all(dim=-1)
    run = correct[..., 1:].int().cumprod(dim=-1).sum(dim=-1) + 1
    return per_slot_correct, per_slot_labelled, run[full]


def gamma_or_default(gamma: float | None, block_size: int) -> float:
    if gamma is None:
        return default_gamma(block_size)
    if not math.isfinite(gamma) or gamma <= 0:
        raise ValueError(f"gamma must be a positive number, got {gamma}")
    return gamma


def uncertainty_weights(target_logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                        share: float) -> torch.Tensor:
    """Anchor weights [B, S]: a `share` of the sampling proportional to the target's uncertainty about
    the anchor token, 1 - p(token at a | tokens before a), the rest uniform.

    Greedy rounds start right after a rejected draft, where the target is unsure far more often than
    at a random position (benchmarks/anchor_difficulty.py: mean p 0.31 against 0.46 on the demo pair).
    `target_logits` [B, S, V] are the target's logits at every position (position a - 1 predicts a).
    """
    p_next = target_logits[:, :-1].float().softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    difficulty = torch.cat([torch.ones_like(p_next[:, :1]), 1.0 - p_next], dim=1)
    eligible = eligible_anchors(loss_mask)
    mean = (difficulty * eligible).sum(1, keepdim=True) / eligible.sum(1, keepdim=True).clamp(min=1)
    return (1.0 - share) + share * difficulty / mean.clamp(min=1e-6)


def miss_weights(predictions: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                 loss_mask: torch.Tensor, share: float) -> torch.Tensor:
    """Anchor weights [B, S]: a `share` of the sampling on the positions where the drafter's OWN next
    greedy round would start after drafting from probe anchors, the rest uniform.

    predictions, labels: [B, A, Bs] the drafter's argmax and the block labels at probe `anchors` [B, A]
    (valid [B, A]). A probe block accepted up to slot k-1 sends the next round to a + k: the token the
    drafter got wrong there, or the bonus token a + Bs after a fully accepted block. A block that runs past
    the response sends it nowhere. These are the anchors decoding visits, where the drafter is worst
    (benchmarks/anchor_difficulty.py: slot-1 accuracy 0.60 there against 0.78 at a random position).
    """
    batch, seq_len = loss_mask.shape
    block_size = labels.shape[-1]
    labelled = labels != IGNORE
    run = ((predictions == labels) & labelled)[..., 1:].int().cumprod(dim=-1).sum(dim=-1)
    k = run + 1  # [B, A] the slot where the next round starts
    missed = labelled.gather(-1, k.clamp(max=block_size - 1)[..., None])[..., 0] & (k < block_size)
    starts = valid & (missed | (k == block_size))
    hits = torch.zeros(batch, seq_len, dtype=torch.bool, device=loss_mask.device)
    hits[torch.arange(batch, device=hits.device)[:, None].expand_as(k)[starts], (anchors + k)[starts].clamp(
        max=seq_len - 1)] = True
    eligible = eligible_anchors(loss_mask)
    hits &= eligible
    share_of_hits = hits.sum(1, keepdim=True) / eligible.sum(1, keepdim=True).clamp(min=1)
    weights = (1.0 - share) + share * hits.float() / share_of_hits.clamp(min=1e-6)
    return torch.where(hits.any(1, keepdim=True), weights, torch.ones_like(weights))  # no start: uniform
