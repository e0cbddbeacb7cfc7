"""Training curves of the demo build, as one PNG (matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

from .build import AR_LINEAGE, DRAFTER_LINEAGE


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _runs(lineage) -> tuple[tuple[str, str | None, str], ...]:
    """(run directory, the run it starts from, legend suffix) per run, parents first."""
    return tuple((run, parent, f" ({what})" if what else "") for run, parent, what in lineage)


RUNS = {"target": (("target", None, ""),), "drafter": _runs(DRAFTER_LINEAGE), "ar": _runs(AR_LINEAGE)}


def plot_curves(work: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    # A run that starts from another run's weights continues that run's curve: its steps are drawn after
    # its parent's last step.
    ends: dict[str, int] = {}
    for ax, runs, title in ((axes[0], RUNS["target"], "target LM"), (axes[2], RUNS["ar"], "autoregressive draft")):
        for run, parent, label in runs:
            records = _read(work / run / "train_log.jsonl")
            log = [r for r in records if "loss" in r]
            if not log:
                continue
            offset = ends.get(parent, 0)
            ax.plot([offset + r["step"] for r in log], [r["loss"] for r in log], label="train loss" + label, lw=0.8)
            held = [r for r in records if "heldout_loss" in r]
            if held:
                ax.plot([offset + r["step"] for r in held], [r["heldout_loss"] for r in held], "o-",
                        label="held-out loss" + label)
            ends[run] = offset + log[-1]["step"]
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    tau_ax = axes[1].twinx()
    for run, parent, label in RUNS["drafter"]:
        records = _read(work / run / "train_log.jsonl")
        log = [r for r in records if "loss" in r]
        if not log:
            continue
        offset = ends.get(parent, 0)
        axes[1].plot([offset + r["step"] for r in log], [r["loss"] for r in log], lw=0.8, label="loss" + label)
        evals = [r for r in records if r.get("event") == "eval"]
        tau_ax.plot([offset + r["step"] for r in evals], [r["tau"] for r in evals], "s-", color="black",
                    label="held-out tau" + label)
        ends[run] = offset + log[-1]["step"]
    axes[1].set_title("DFlash drafter")
    axes[1].set_xlabel("step")
    tau_ax.set_ylabel("tau (T=0, block 16)")
    handles = axes[1].get_legend_handles_labels()
    more = tau_ax.get_legend_handles_labels()
    tau_ax.legend(handles[0] + more[0], handles[1] + more[1], loc="center right", fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
