"""What a bench run shows: one row per method and temperature, as a Markdown table, JSON and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from .load import percentile
from .methods import Sample
from .runner import BenchRun

COLUMNS = ("method", "T", "decode tok/s", "speedup", "tau", "TTFT ms", "TPOT ms", "draft ms/round",
           "verify ms/round", "greedy = target")


def summarize(run: BenchRun, reference: str, unavailable: dict[str, str] | None = None) -> list[dict]:
    """One dict per (method, temperature) in run order; `speedup` is decode tokens/s over `reference`'s
    at the same temperature in the same run; greedy rows compare token ids with `reference`'s."""
    unavailable = dict(unavailable or {})
    rows = []
    for temperature in run.settings.temperatures:
        ref = run.samples.get((reference, temperature), [])
        ref_rate = _rate(ref)
        for name in run.methods:
            samples = run.samples.get((name, temperature))
            if not samples:
                reason = run.errors.get(name) or unavailable.get(name) or "no samples"
                rows.append({"method": name, "temperature": temperature, "unavailable": reason})
                continue
            rows.append(_row(name, temperature, samples, ref, ref_rate, name == reference))
    for name, reason in unavailable.items():
        if name not in run.methods:
            rows.append({"method": name, "temperature": None, "unavailable": reason})
    return rows


def _rate(samples: list[Sample]) -> float:
    seconds = sum(s.decode_s for s in samples)
    return sum(s.decode_tokens for s in samples) / seconds if seconds > 0 else 0.0


def _row(name: str, temperature: float, samples: list[Sample], ref: list[Sample], ref_rate: float,
         is_reference: bool) -> dict:
    rate = _rate(samples)
    hist = Counter(k for s in samples for k in s.committed)
    rounds = sum(hist.values())
    drafted = [s for s in samples if s.draft_s is not None]

    def per_round(total: float) -> float | None:
        return round(1000 * total / rounds, 3) if rounds else None

    decode_s = sum(s.decode_s for s in samples)
    draft_s = sum(s.draft_s for s in drafted) if drafted else None
    verify_s = sum(s.verify_s for s in samples)
    tpot = [1000 * s.decode_s / s.decode_tokens for s in samples if s.decode_tokens]
    row = {
        "method": name, "temperature": temperature, "prompts": len(samples),
        "generated_tokens": sum(len(s.token_ids) for s in samples),
        "decode_tokens_per_s": round(rate, 3),
        "speedup": round(rate / ref_rate, 3) if ref_rate else None,
        "tau": round(sum(k * n for k, n in hist.items()) / rounds, 3) if rounds else None,
        "acceptance_histogram": {str(k): v for k, v in sorted(hist.items())},
        "rounds": rounds,
        "ttft_ms": {"p50": percentile([1000 * s.ttft_s for s in samples], 50),
                    "mean": round(1000 * statistics.fmean(s.ttft_s for s in samples), 3)},
        "tpot_ms": {"p50": percentile(tpot, 50), "mean": round(1000 / rate, 3) if rate else None},
        "draft_ms_per_round": per_round(draft_s) if draft_s is not None else None,
        "verify_ms_per_round": per_round(verify_s),
        "other_ms_per_round": per_round(decode_s - verify_s - (draft_s or 0.0)),
        "greedy_equal": None,
    }
    if temperature == 0.0 and ref and not is_reference:
        same = sum(a.token_ids == b.token_ids for a, b in zip(samples, ref))
        row["greedy_equal"] = {"equal": same, "prompts": min(len(samples), len(ref))}
    elif temperature == 0.0 and is_reference:
        row["greedy_equal"] = "reference"
    return row


# -- terminal ------------------------------------------------------------------------------------


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        t = "-" if r["temperature"] is None else f"{r['temperature']:g}"
        if "unavailable" in r:
            reason = _one_line(r["unavailable"])
            lines.append(f"| {r['method']} | {t} | unavailable: {reason} |" + " |" * (len(COLUMNS) - 3))
            continue
        cells = [r["method"], t, f"{r['decode_tokens_per_s']:.1f}", _num(r["speedup"], "x"), _num(r["tau"]),
                 _num(r["ttft_ms"]["p50"]), _num(r["tpot_ms"]["p50"]), _num(r["draft_ms_per_round"]),
                 _num(r["verify_ms_per_round"]), _greedy(r["greedy_equal"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(v: float | None, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{suffix}"


def _greedy(g: dict[str, int] | str | None) -> str:
    if g is None:
        return "-"
    if g == "reference":
        return "reference"
    mark = "yes" if g["equal"] == g["prompts"] else "NO"
    return f"{mark} ({g['equal']}/{g['prompts']})"


def _one_line(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "/")[:160]


def machine() -> dict:
    import torch
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# -- files ---------------------------------------------------------------------------------------


def write_outputs(out_dir: Path, rows: list[dict], meta: dict, profile_text: str | None = None) -> list[Path]:
    """bench.json, results.md (table + machine + command + plots) and the three PNGs; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**meta, "rows": rows}
    (out_dir / "bench.json").write_text(json.dumps(data, indent=2) + "\n")
    pngs = plot_all(out_dir, rows)
    md = [f"Measured {meta['machine']['date_utc']} on {describe_machine(meta['machine'])} with:", "",
          "```bash", meta["command"], "```", "", markdown_table(rows), ""]
    md += [f"![{p.stem}]({p.name})" for p in pngs]
    if profile_text:
        md += ["", "One DFlash round on this machine:", "", profile_text]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    return [out_dir / "bench.json", out_dir / "results.md", *pngs]


def describe_machine(m: dict) -> str:
    where = m.get("gpu") or f"{m['processor']}, {m['cpu_count']} CPU cores ({m['torch_threads']} torch threads)"
    return f"{where}, torch {m['torch']}, transformers {m['transformers']}"


def plot_all(out_dir: Path, rows: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    done = [r for r in rows if "unavailable" not in r]
    temps = sorted({r["temperature"] for r in done})
    names = list(dict.fromkeys(r["method"] for r in done))
    paths = [out_dir / "speedup.png", out_dir / "tau_histogram.png", out_dir / "round_time.png"]
    _plot_speedup(paths[0], done, names, temps)
    _plot_histograms(paths[1], done, temps)
    _plot_round_time(paths[2], done, temps[0] if temps else 0.0)
    return paths


def _plot_speedup(path: Path, rows: list[dict], names: list[str], temps: list[float]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.55 * max(len(names), 1)))
    height = 0.8 / max(len(temps), 1)
    for j, t in enumerate(temps):
        by_name = {r["method"]: r["speedup"] or 0.0 for r in rows if r["temperature"] == t}
        ys = [i + j * height for i in range(len(names))]
        bars = ax.barh(ys, [by_name.get(n, 0.0) for n in names], height=height, label=f"T={t:g}")
        ax.bar_label(bars, fmt="%.2fx", padding=2, fontsize=8)
    ax.set_yticks([i + height * (len(temps) - 1) / 2 for i in range(len(names))], names)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("decode speedup over the target alone (same run)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_histograms(path: Path, rows: list[dict], temps: list[float]) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, max(len(temps), 1), figsize=(6 * max(len(temps), 1), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        spec = [r for r in rows if r["temperature"] == t and r["tau"] and r["acceptance_histogram"].keys() - {"1"}]
        for r in spec:
            hist = {int(k): v for k, v in r["acceptance_histogram"].items()}
            total = sum(hist.values())
            ks = range(1, max(hist) + 1)
            ax.plot(ks, [hist.get(k, 0) / total for k in ks], marker="o", ms=3,
                    label=f"{r['method']} (tau {r['tau']:.2f})")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"tokens committed per round, T={t:g}")
        ax.set_xlabel("committed tokens (bonus included)")
        ax.set_ylabel("fraction of rounds")
        if spec:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_round_time(path: Path, rows: list[dict], temperature: float) -> None:
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r["temperature"] == temperature and r["rounds"]]
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.55 * max(len(rs), 1)))
    left = [0.0] * len(rs)
    for key, label in (("draft_ms_per_round", "draft"), ("verify_ms_per_round", "verify"),
                       ("other_ms_per_round", "other (sampling, bookkeeping, Python)")):
        vals = [max(r[key] or 0.0, 0.0) for r in rs]
        ax.barh(range(len(rs)), vals, left=left, label=label)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(rs)), [f"{r['method']} (tau {r['tau']:.2f})" for r in rs])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per decode round, T={temperature:g}")
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
