"""The training loop: frozen target features in, a DFlash drafter out.

Per optimizer step: for each micro-batch, target features (no grad), random anchors, one drafter
forward over ALL blocks of every sequence (block-sparse mask), weighted block loss, backward; then
clip, AdamW, cosine schedule. Checkpoints land on step boundaries and resume exactly. Every epoch
ends with tau measured by the real engine on held-out prompts and a drafter in the public format.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from ..drafter.checkpoint import save_drafter
from ..drafter.config import DFlashConfig
from ..drafter.model import DFlashDraftModel
from ..errors import DFlashError
from .blocks import (
    IGNORE,
    Blocks,
    gamma_or_default,
    loss_weights,
    make_blocks,
    miss_weights,
    sample_anchors,
    uncertainty_weights,
)
from .config import TrainConfig
from .data import Batch, Sample, collate, epoch_batches
from .evaluate import EvalResult, evaluate_tau
from .features import FeatureSource
from .loss import BlockLoss, block_loss
from .state import Progress, load_state, restore_state, save_state

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Meter:
    """Running sums between two log lines."""

    steps: int = 0
    loss: float = 0.0
    ce: float = 0.0
    kl: float = 0.0
    grad_norm: float = 0.0
    tokens: int = 0
    block_tokens: int = 0
    seconds: float = 0.0
    slot_correct: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    slot_labelled: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    accepted: list[torch.Tensor] = field(default_factory=list)

    def add(self, part: BlockLoss, batch: Batch, scale: float) -> None:
        self.loss += float(part.loss.detach()) * scale
        self.ce += part.ce * scale
        self.kl += part.kl * scale
        if not self.slot_correct.numel():  # first batch: now the block size is known
            self.slot_correct, self.slot_labelled = part.slot_correct.clone(), part.slot_labelled.clone()
        else:
            self.slot_correct += part.slot_correct
            self.slot_labelled += part.slot_labelled
        self.accepted.append(part.accepted)
        self.tokens += batch.num_tokens
        self.block_tokens += int(part.slot_labelled.sum())

    def summary(self) -> dict:
        """Means per step; acc[k-1] is the accuracy of block slot k; train_tau the mean accepted length
        of full training blocks (what tau would be if the training blocks were drafts)."""
        n = max(self.steps, 1)
        acc = (self.slot_correct / self.slot_labelled.clamp(min=1)).tolist()[1:]
        accepted = torch.cat(self.accepted) if self.accepted else torch.zeros(0)
        return {
            "loss": self.loss / n, "ce": self.ce / n, "kl": self.kl / n, "grad_norm": self.grad_norm / n,
            "acc": [round(a, 4) for a in acc],
            "train_tau": float(accepted.float().mean()) if accepted.numel() else 0.0,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "block_tokens_per_s": self.block_tokens / self.seconds if self.seconds else 0.0,
        }


class Trainer:
    """Trains a fresh drafter for `model` (a loaded, frozen Hugging Face causal LM).

    samples: tokenized training data; features: where target features come from (online or cached);
    eval_prompts: token-id prompts for the end-of-epoch tau measurement (may be empty).
    """

    def __init__(
        self,
        config: TrainConfig,
        model: PreTrainedModel,
        drafter_config: DFlashConfig,
        samples: list[Sample],
        features: FeatureSource,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eval_prompts: list[list[int]] = (),
        pad_id: int = 0,
        init_weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.samples = samples
        self.features = features
        self.tokenizer = tokenizer
        self.eval_prompts = list(eval_prompts)
        self.pad_id = pad_id
        self.out_dir = Path(config.out_dir)
        self.device = model.device
        for p in model.parameters():
            p.requires_grad_(False)
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()

        torch.manual_seed(config.seed)
        self.drafter = DFlashDraftModel(drafter_config).to(self.device, torch.float32)
        _init_weights(self.drafter, std=0.02)
        if init_weights is not None:
            self.drafter.load_state_dict(init_weights)
        self.drafter.train()
        self.weights = loss_weights(config.block_size, gamma_or_default(config.gamma, config.block_size))
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        self.num_batches = math.ceil(len(samples) / config.batch_size)
        self.steps_per_epoch = math.ceil(self.num_batches / config.grad_accum)
        self.total_steps = config.epochs * self.steps_per_epoch
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        warmup = math.ceil(config.warmup_ratio * self.total_steps)
        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, warmup, self.total_steps)
        self.anchor_generator = torch.Generator().manual_seed(config.seed)
        self.progress = Progress()
        self.amp = _amp_enabled(config.amp, self.device)
        self.sparse_mask = _sparse_attention(config.attention, self.device, self.drafter)

    # -- one step -----------------------------------------------------------------------------------

    def forward_loss(self, batch: Batch) -> BlockLoss:
        """Loss of one micro-batch: every block of every sequence in one drafter forward."""
        cfg = self.config
        target = self.features(batch)
        ids, loss_mask = batch.input_ids.to(self.device), batch.loss_mask.to(self.device)
        weights = None
        if cfg.hard_anchors > 0:
            if target.last_hidden is None:
                raise DFlashError("--hard-anchors needs the target's last hidden state; build the features "
                                  "with with_last_hidden=config.needs_last_hidden")
            with torch.no_grad():
                logits = self.lm_head(target.last_hidden.to(self.lm_head.weight.dtype))
                weights = uncertainty_weights(logits, ids, loss_mask, cfg.hard_anchors)
        if cfg.miss_anchors > 0:
            misses = self.probe_misses(ids, loss_mask, target.features)
            weights = misses if weights is None else weights * misses
        anchors, valid = sample_anchors(loss_mask, cfg.max_anchors, self.anchor_generator, weights)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            hidden, blocks = self.draft(ids, loss_mask, target.features, anchors, valid)
            teacher = None
            if cfg.distill_weight > 0:
                flat = blocks.teacher_positions.view(ids.shape[0], -1)
                last = target.last_hidden
                teacher = last.gather(1, flat[..., None].expand(-1, -1, last.shape[-1])).view(*blocks.labels.shape, -1)
            return block_loss(hidden, self.lm_head, blocks.labels, self.weights, teacher, cfg.distill_weight)

    def draft(self, ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor,
              valid: torch.Tensor) -> tuple[torch.Tensor, Blocks]:
        """The drafter's hidden states [B, A*Bs, H] for blocks at `anchors`, and those blocks."""
        blocks = make_blocks(ids, loss_mask, anchors, valid, self.config.block_size,
                             self.drafter.config.mask_token_id, sparse_mask=self.sparse_mask)
        batch_size, seq_len = ids.shape
        context_positions = torch.arange(seq_len, device=self.device).expand(batch_size, -1)
        positions = torch.cat([context_positions, blocks.positions], dim=1)
        with torch.no_grad():
            noise = self.embed_tokens(blocks.token_ids).float()
        hidden = self.drafter(noise, features.float(), positions, attention_mask=blocks.attention_mask)
        return hidden, blocks

    def probe_misses(self, ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Anchor weights from one no-grad drafter pass at uniform probe anchors: where its own next
        rounds would start (`miss_weights`). Draws its probes from the anchor generator, so it resumes."""
        anchors, valid = sample_anchors(loss_mask, self.config.max_anchors, self.anchor_generator)
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            hidden, blocks = self.draft(ids, loss_mask, features, anchors, valid)
            labelled = blocks.labels != IGNORE
            predictions = torch.full_like(blocks.labels, IGNORE)
            slots = hidden.view(*blocks.labels.shape, -1)[labelled]
            predictions[labelled] = self.lm_head(slots.to(self.lm_head.weight.dtype)).argmax(-1)
        return miss_weights(predictions, blocks.labels, anchors, valid, loss_mask, self.config.miss_anchors)

    def train_step(self, batches: list[Batch], meter: Meter | None = None) -> float:
        """One optimizer step over micro-batches (gradient accumulation); returns the mean loss."""
        t0 = time.perf_counter()
        total = 0.0
        for batch in batches:
            part = self.forward_loss(batch)
            (part.loss / len(batches)).backward()
            total += float(part.loss.detach()) / len(batches)
            if meter is not None:
                meter.add(part, batch, 1 / len(batches))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if meter is not None:
            meter.steps += 1
            meter.grad_norm += float(grad_norm)
            meter.seconds += time.perf_counter() - t0
        return total

    # -- the loop -----------------------------------------------------------------------------------

    def fit(self) -> Path:
        """Train from the current progress (fresh, or after `resume()`) to the end; returns out_dir."""
        cfg, progress = self.config, self.progress
        meter = Meter()
        bar = tqdm(total=self.total_steps, initial=progress.step, desc="training drafter", unit="step")
        epoch_closed = progress.epoch > 0 and progress.batch_in_epoch == 0
        while progress.step < self.total_steps:
            plan = epoch_batches(len(self.samples), cfg.batch_size, cfg.seed, progress.epoch)
            while progress.batch_in_epoch < len(plan) and progress.step < self.total_steps:
                group = plan[progress.batch_in_epoch : progress.batch_in_epoch + cfg.grad_accum]
                self.train_step([self.batch(indices) for indices in group], meter)
                progress.batch_in_epoch += len(group)
                progress.step += 1
                epoch_closed = False
                bar.update(1)
                if progress.step % cfg.log_every == 0 or progress.step == self.total_steps:
                    self._log_train(meter, bar)
                    meter = Meter()
                if progress.step % cfg.save_every == 0:
                    self.save_checkpoint()
            if progress.batch_in_epoch >= len(plan):
                self.end_epoch()
                epoch_closed = True
        bar.close()
        if not epoch_closed:
            self.evaluate()
        save_drafter(self.drafter, self.out_dir, SAVE_DTYPES[cfg.save_dtype])
        self.save_checkpoint()
        return self.out_dir

    def end_epoch(self) -> None:
        """Measure tau, save out_dir/epoch-N, move to the next epoch and checkpoint there."""
        number = self.progress.epoch + 1
        self.evaluate(epoch=number)
        save_drafter(self.drafter, self.out_dir / f"epoch-{number}", SAVE_DTYPES[self.config.save_dtype])
        self.progress.epoch += 1
        self.progress.batch_in_epoch = 0
        self.save_checkpoint()

    def evaluate(self, epoch: int | None = None) -> EvalResult | None:
        if not self.eval_prompts:
            return None
        result = evaluate_tau(self.model, self.tokenizer, self.drafter, self.eval_prompts,
                              self.config.eval_max_new_tokens)
        self._write_log({"event": "eval", "epoch": epoch, "step": self.progress.step, **result.to_dict()})
        tqdm.write(f"eval after step {self.progress.step}: tau {result.tau:.3f} over {result.rounds} rounds")
        return result

    def batch(self, indices: list[int]) -> Batch:
        return collate([self.samples[i] for i in indices], indices, self.pad_id)

    # -- checkpoints and logs -------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        save_state(self.out_dir / "checkpoint", drafter=self.drafter, optimizer=self.optimizer,
                   scheduler=self.scheduler, progress=self.progress, anchor_generator=self.anchor_generator,
                   config=self.config.to_dict(), drafter_config=self.drafter.config.raw)

    def resume(self) -> None:
        """Continue from out_dir/checkpoint; the step-changing settings must match the saved run."""
        state = load_state(self.out_dir / "checkpoint")
        mismatch = self.config.resume_mismatch(state["config"])
        if mismatch is None and state["drafter_config"] != self.drafter.config.raw:
            mismatch = "drafter config (target, layers or mask token)"
        if mismatch is not None:
            raise DFlashError(f"--resume: the checkpoint was trained with other settings ({mismatch}); "
                              "use the same flags or a new --out directory")
        self.progress = restore_state(state, drafter=self.drafter, optimizer=self.optimizer,
                                      scheduler=self.scheduler, anchor_generator=self.anchor_generator)
        self._truncate_log(self.progress.step)

    def _log_train(self, meter: Meter, bar: tqdm) -> None:
        summary = meter.summary()
        lr = self.scheduler.get_last_lr()[0]
        self._write_log({"event": "train", "step": self.progress.step, "epoch": self.progress.epoch,
                         "lr": lr, **summary})
        bar.set_postfix_str(
            f"loss {summary['loss']:.3f} acc {_compact(summary['acc'])} tau~{summary['train_tau']:.2f} "
            f"{summary['tokens_per_s']:.0f} tok/s"
        )

    def _truncate_log(self, step: int) -> None:
        """Drop log lines of steps after the checkpoint: the resumed run writes them again."""
        path = self.out_dir / "train_log.jsonl"
        if path.is_file():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line).get("step", 0) <= step]
            path.write_text("".join(kept))

    def _write_log(self, record: dict) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / "train_log.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def _compact(acc: list[float]) -> str:
    """Accuracy of slots 1, 2, 3, 4, 8 and the last, in percent: '71/52/40/31/12/3'."""
    picks = sorted({k for k in (1, 2, 3, 4, 8, len(acc)) if 1 <= k <= len(acc)})
    return "/".join(f"{100 * acc[k - 1]:.0f}" for k in picks)


def _amp_enabled(amp: str, device: torch.device) -> bool:
    if amp == "off":
        return False
    if amp == "bf16":
        return True
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # Without AMX tiles CPU bf16 matmuls are slower than fp32 (a training step: 1.4x slower on AVX512-BF16).
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return device.type == "cpu" and bool(is_amx())


def _sparse_attention(attention: str, device: torch.device, drafter: DFlashDraftModel) -> bool:
    """Whether the block mask is a flex-attention BlockMask (--attention sparse, CUDA only)."""
    if attention == "dense":
        return False
    if device.type != "cuda":
        raise DFlashError(f"--attention sparse needs a CUDA device (PyTorch has no flex-attention backward on "
                          f"{device.type}); use --attention dense")
    if drafter.has_sliding_window:
        raise DFlashError("--attention sparse does not support drafters with sliding-window layers; "
                          "use --attention dense")
    return True


def _init_weights(model: torch.nn.Module, std: float) -> None:
    """Normal(0, std) for every projection, as Hugging Face initialises Qwen3; norms stay at 1."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
