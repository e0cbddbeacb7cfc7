"""Training settings: one frozen dataclass, built once at the edge (the CLI) and validated there."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..errors import DFlashError


class TrainConfigError(DFlashError):
    """A training setting is out of range; the message names the flag."""


@dataclass(frozen=True)
class TrainConfig:
    """How to train a drafter for one target.

    Paths: `target` (Hugging Face causal LM directory), `data` (JSONL, see data.py), `out_dir` (final
    drafter, epoch-N/ drafters, checkpoint/, train_log.jsonl, regenerated.jsonl, features/).
    Drafter shape: block_size, num_layers, target_layer_ids (None: the paper's spread over
    num_features layers), mask_token_id (None: the tokenizer's mask token).
    Optimisation (paper defaults): AdamW lr 6e-4, cosine schedule, warmup_ratio 0.04, grad_clip 1.0.
    Loss: weights exp(-(k-1)/gamma) (gamma None: 7 for block 16, 5 for 10, 4 for 8);
    distill_weight in [0, 1] mixes in KL from the target's softmax.
    hard_anchors in [0, 1]: the share of anchor sampling weighted by the target's uncertainty about the
    anchor token (1 - its probability), the rest uniform; 0 samples uniformly (the paper).
    miss_anchors in [0, 1]: the share of anchor sampling on the positions where the drafter's own next
    greedy round would start (found by one no-grad drafter pass at uniform probe anchors per micro-batch).
    init_drafter: a drafter directory whose weights replace the fresh init (optimizer and schedule start
    anew); its config must equal the one these flags build, except that explicit target_layer_ids may name
    other layers (as many) than it read.
    """

    target: str
    data: str
    out_dir: str
    block_size: int = 16
    num_layers: int = 1
    num_features: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 4
    grad_accum: int = 1
    max_length: int = 2048
    max_anchors: int = 512
    gamma: float | None = None
    distill_weight: float = 0.0
    hard_anchors: float = 0.0
    miss_anchors: float = 0.0
    offline_features: bool = False
    regenerate: bool = False
    regen_max_new_tokens: int = 256
    regen_temperature: float = 0.0
    regen_batch_size: int = 8
    eval_prompts: str | None = None
    eval_max_new_tokens: int = 128
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"
    attention: str = "dense"
    save_dtype: str = "bfloat16"
    resume: bool = False
    init_drafter: str | None = None

    def __post_init__(self) -> None:
        if self.target_layer_ids is not None:
            object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        for name in ("block_size", "num_layers", "epochs", "batch_size", "grad_accum", "max_length",
                     "max_anchors", "regen_max_new_tokens", "regen_batch_size", "eval_max_new_tokens",
                     "save_every", "log_every"):
            _positive_int(name, getattr(self, name))
        if self.block_size < 2:
            raise TrainConfigError(f"--block-size must be at least 2 (the anchor plus drafts), got {self.block_size}")
        if self.max_length <= self.block_size:
            raise TrainConfigError(f"--max-length {self.max_length} must exceed --block-size {self.block_size}")
        for name in ("num_features", "max_steps"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.num_features is not None and self.target_layer_ids is not None \
                and self.num_features != len(self.target_layer_ids):
            raise TrainConfigError("--num-features and --target-layer-ids disagree; give one of them")
        if self.target_layer_ids is not None and (not self.target_layer_ids or min(self.target_layer_ids) < 0):
            raise TrainConfigError("--target-layer-ids must be non-negative decoder layer indices")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise TrainConfigError(f"--mask-token-id must be a token id >= 0, got {self.mask_token_id}")
        _finite("lr", self.lr, low=0.0, low_open=True)
        _finite("warmup_ratio", self.warmup_ratio, low=0.0, high=1.0)
        _finite("weight_decay", self.weight_decay, low=0.0)
        _finite("grad_clip", self.grad_clip, low=0.0, low_open=True)
        _finite("distill_weight", self.distill_weight, low=0.0, high=1.0)
        _finite("hard_anchors", self.hard_anchors, low=0.0, high=1.0)
        _finite("miss_anchors", self.miss_anchors, low=0.0, high=1.0)
        _finite("regen_temperature", self.regen_temperature, low=0.0)
        if self.gamma is not None:
            _finite("gamma", self.gamma, low=0.0, low_open=True)
        if self.seed < 0:
            raise TrainConfigError(f"--seed must be >= 0, got {self.seed}")
        if self.amp not in ("auto", "bf16", "off"):
            raise TrainConfigError(f"--amp must be auto, bf16 or off, got {self.amp!r}")
        if self.attention not in ("dense", "sparse"):
            raise TrainConfigError(f"--attention must be dense or sparse, got {self.attention!r}")
        if self.save_dtype not in ("bfloat16", "float16", "float32"):
            raise TrainConfigError(f"save dtype must be bfloat16, float16 or float32, got {self.save_dtype!r}")
        if not Path(self.data).is_file():
            raise TrainConfigError(f"--data '{self.data}' is not a file")
        if self.init_drafter is not None and not (Path(self.init_drafter) / "config.json").is_file():
            raise TrainConfigError(f"--init-drafter '{self.init_drafter}' is not a drafter directory "
                                   "(no config.json there)")
        if self.eval_prompts is not None and not Path(self.eval_prompts).is_file():
            raise TrainConfigError(f"--eval-prompts '{self.eval_prompts}' is not a file")

    @property
    def needs_last_hidden(self) -> bool:
        """Whether steps read the target's own predictions (distillation, uncertainty-weighted anchors)."""
        return self.distill_weight > 0 or self.hard_anchors > 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids) if self.target_layer_ids is not None else None
        return out

    # Settings that change what a step computes; a resumed run must keep them.
    RESUME_KEYS = ("block_size", "num_layers", "num_features", "target_layer_ids", "mask_token_id", "lr",
                   "warmup_ratio", "weight_decay", "grad_clip", "batch_size", "grad_accum", "max_length",
                   "max_anchors", "gamma", "distill_weight", "hard_anchors", "miss_anchors", "seed", "epochs",
                   "max_steps", "init_drafter")

    def resume_mismatch(self, saved: dict) -> str | None:
        """The first step-changing setting that differs from a checkpoint's, as 'name: saved -> now'."""
        now = self.to_dict()
        defaults = {f.name: f.default for f in fields(self)}
        for key in self.RESUME_KEYS:
            # A checkpoint written before a setting existed ran with its default.
            if key in defaults and saved.get(key, defaults[key]) != now[key]:
                return f"{key}: {saved.get(key, defaults[key])!r} -> {now[key]!r}"
        return None


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _finite(name: str, value: object, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> None:
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TrainConfigError(f"{flag} must be a finite number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise TrainConfigError(f"{flag} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise TrainConfigError(f"{flag} must be <= {high}, got {value}")
