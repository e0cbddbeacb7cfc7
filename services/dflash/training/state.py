"""The resumable training checkpoint: drafter weights, optimizer, scheduler, progress and every RNG.

Written atomically to `out_dir/checkpoint/trainer_state.pt` at optimizer-step boundaries, so a resumed
run replays the same batches, anchors and updates as an uninterrupted one.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DFlashError

STATE_FILE = "trainer_state.pt"


@dataclass
class Progress:
    """Where training stands: optimizer steps done, the epoch, and batches consumed within it."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def save_state(
    directory: Path,
    *,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    progress: Progress,
    anchor_generator: torch.Generator,
    config: dict,
    drafter_config: dict,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "drafter": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "progress": progress.__dict__.copy(),
        "rng": {
            "anchors": anchor_generator.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
        "config": config,
        "drafter_config": drafter_config,
    }
    path = directory / STATE_FILE
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_state(directory: Path) -> dict:
    path = directory / STATE_FILE
    if not path.is_file():
        raise DFlashError(f"--resume: no training checkpoint at '{path}'; start without --resume")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        raise DFlashError(f"--resume: cannot read '{path}' ({type(exc).__name__}: {exc})") from None


def restore_state(
    state: dict,
    *,
    drafter: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    anchor_generator: torch.Generator,
) -> Progress:
    """Load everything `save_state` wrote back into live objects; returns the progress."""
    drafter.load_state_dict(state["drafter"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    anchor_generator.set_state(rng["anchors"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return Progress(**state["progress"])
