"""Training curves of the demo build, as one PNG (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(work: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, name, title in ((axes[0], "target", "target LM"), (axes[2], "ar-draft", "autoregressive draft")):
        log = [r for r in _read(work / name / "train_log.jsonl") if "loss" in r]
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], label="train loss", lw=0.8)
        held = [r for r in _read(work / name / "train_log.jsonl") if "heldout_loss" in r]
        if held:
            ax.plot([r["step"] for r in held], [r["heldout_loss"] for r in held], "o-", label="held-out loss")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    log = [r for r in _read(work / "drafter" / "train_log.jsonl") if "loss" in r]
    axes[1].plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.8, label="loss")
    axes[1].set_title("DFlash drafter")
    axes[1].set_xlabel("step")
    axes[1].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
