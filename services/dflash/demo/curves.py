"""Training curves of a demo build (target, drafter, AR draft), as one PNG (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(work: Path, out: Path) -> Path:
    """Train and held-out loss of the target and the AR draft; the drafter's loss and held-out tau."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, run, title in ((axes[0], "target", "target LM"), (axes[2], "ar-draft", "autoregressive draft")):
        records = _read(work / run / "train_log.jsonl")
        log = [r for r in records if "loss" in r]
        ax.plot([r["step"] for r in log], [r["loss"] for r in log], label="train loss", lw=0.8)
        held = [r for r in records if "heldout_loss" in r]
        ax.plot([r["step"] for r in held], [r["heldout_loss"] for r in held], "o-", label="held-out loss")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    records = _read(work / "drafter" / "train_log.jsonl")
    log = [r for r in records if "loss" in r]
    axes[1].plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.8, label="loss")
    tau_ax = axes[1].twinx()
    evals = [r for r in records if r.get("event") == "eval"]
    tau_ax.plot([r["step"] for r in evals], [r["tau"] for r in evals], "s-", color="black", label="held-out tau")
    axes[1].set_title("DFlash drafter")
    axes[1].set_xlabel("step")
    tau_ax.set_ylabel("tau (T=0, block 16)")
    handles, labels = axes[1].get_legend_handles_labels()
    more_handles, more_labels = tau_ax.get_legend_handles_labels()
    tau_ax.legend(handles + more_handles, labels + more_labels, loc="center right", fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
