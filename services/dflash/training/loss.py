"""The block loss: position-weighted cross-entropy on same-position labels, optionally mixed with
distillation (KL from the target's softmax), plus the accuracy counts the progress bar shows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .blocks import IGNORE, block_accuracy


@dataclass(frozen=True)
class BlockLoss:
    """loss: the scalar to minimise; ce / kl: its parts (kl 0 without distillation), detached.

    slot_correct / slot_labelled: [Bs] counts per block slot; accepted: accepted length of each full block.
    """

    loss: torch.Tensor
    ce: float
    kl: float
    slot_correct: torch.Tensor
    slot_labelled: torch.Tensor
    accepted: torch.Tensor


def block_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    distill_weight: float = 0.0,
) -> BlockLoss:
    """Loss over the labelled slots only (the lm_head never runs on slot 0 or padding).

    hidden: [B, A*Bs, H] drafter output; labels: [B, A, Bs] (IGNORE = no loss); weights: [Bs].
    teacher_hidden: [B, A, Bs, H] the target's final hidden state at label position - 1 (its logits
        there are the target's distribution for the label), needed when distill_weight > 0.
    loss = (1 - distill_weight) * CE + distill_weight * KL(target || drafter), each weighted per slot
    by `weights` and normalised by the total weight of the labelled slots.
    """
    batch, num_anchors, block_size = labels.shape
    labelled = labels != IGNORE
    flat_hidden = hidden.view(batch, num_anchors, block_size, -1)[labelled]
    head_dtype = lm_head.weight.dtype
    logits = lm_head(flat_hidden.to(head_dtype)).float()
    slot_weight = weights.to(logits.device).expand(batch, num_anchors, -1)[labelled]
    total_weight = slot_weight.sum().clamp(min=1e-8)
    log_probs = F.log_softmax(logits, dim=-1)
    ce = -(log_probs.gather(1, labels[labelled][:, None]).squeeze(1) * slot_weight).sum() / total_weight
    kl = torch.zeros((), device=logits.device)
    if distill_weight > 0:
        with torch.no_grad():
            teacher = F.log_softmax(lm_head(teacher_hidden[labelled].to(head_dtype)).float(), dim=-1)
        kl_per_slot = (teacher.exp() * (teacher - log_probs)).sum(dim=-1)
        kl = (kl_per_slot * slot_weight).sum() / total_weight
    loss = (1 - distill_weight) * ce + distill_weight * kl

    predictions = torch.full_like(labels, IGNORE)
    predictions[labelled] = logits.argmax(dim=-1).detach()
    correct, count, accepted = block_accuracy(predictions, labels)
    return BlockLoss(loss, float(ce.detach()), float(kl.detach()), correct.cpu(), count.cpu(), accepted.cpu())
