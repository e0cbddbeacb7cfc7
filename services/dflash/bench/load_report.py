"""What a load sweep shows: a Markdown table (a row per concurrency, columns per method), the
method ratio per concurrency, load.json and load.png. No torch here."""

from __future__ import annotations

import json
import os
import platform
from datetime import UTC, datetime
from pathlib import Path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _slashed(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def _pair(d: dict) -> str:
    return f"{_ms(d['p50'])} / {_ms(d['p99'])}"


def methods_of(result: dict) -> list[str]:
    return [m["name"] for m in result["settings"]["methods"]]


def cell_table(result: dict) -> dict[tuple[str, int], dict]:
    return {(c["method"], c["concurrency"]): c for c in result["cells"]}


def markdown_table(result: dict) -> str:
    """Rows: concurrency (c=1 is the sequential baseline); per method: aggregate tok/s, x vs c=1,
    TTFT p50 / p99 ms, TPOT p50 / p99 ms."""
    methods, cells = methods_of(result), cell_table(result)
    head = ["c"] + [f"{m} {col}" for m in methods for col in ("tok/s", "x vs c=1", "TTFT p50/p99 ms",
                                                              "TPOT p50/p99 ms")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in sorted({c for _, c in cells}):
        row = [str(c)]
        for m in methods:
            cell = cells.get((m, c))
            row += (["-"] * 4 if cell is None else
                    [f"{cell['tokens_per_s']:.1f}", _x(cell["speedup_vs_c1"]), _pair(cell["ttft_ms"]),
                     _pair(cell["tpot_ms"])])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary_lines(result: dict) -> list[str]:
    """The method ratio per concurrency, mean tau, and the requests and errors of the sweep."""
    lines = [f"{name} aggregate tok/s: " + ", ".join(f"c={c} {_x(v)}" for c, v in by_c.items())
             for name, by_c in result["ratios"].items()]
    cells = cell_table(result)
    for m in methods_of(result):
        taus = [(c, cell["tau"]) for (name, c), cell in sorted(cells.items()) if name == m and cell["tau"]]
        if taus:
            lines.append(f"{m} mean tau: " + ", ".join(f"c={c} {t:.2f}" for c, t in taus))
    s = result["settings"]
    if "passes" in result:
        per_pass = "; ".join(f"{c['method']} c={c['concurrency']} {_slashed(c['tokens_per_s_passes'])}"
                             for c in result["cells"])
        lines.append(f"{len(result['passes'])} passes: each cell its median pass, each ratio the median of the "
                     f"passes' own; tok/s per pass: {per_pass}")
    every = [c for cells in result.get("passes", [result["cells"]]) for c in cells]  # errors of every pass
    requests = sum(c["requests"] for c in every)
    errors = [c for c in every if c["errors"]]
    lines.append(f"{requests} requests ({s['requests_per_stream']} per stream, {s['max_new_tokens']} new tokens, "
                 f"T={s['temperature']:g}); errors: " +
                 (", ".join(f"{c['method']} c={c['concurrency']} {c['error_codes']}" for c in errors) or "none"))
    return lines


def format_sweep(result: dict) -> str:
    return markdown_table(result) + "\n\n" + "\n".join(summary_lines(result))


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}


def write_outputs(out: Path, result: dict, meta: dict) -> list[Path]:
    """out/load.json (the sweep and `meta`: command, machine, ...) and out/load.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "load.json", out / "load.png"]
    paths[0].write_text(json.dumps({**meta, **result}, indent=2) + "\n")
    plot(result, paths[1])
    return paths


def plot(result: dict, path: Path) -> None:
    """Left: aggregate tok/s vs concurrency per method; right: TPOT p50 vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells, s = cell_table(result), result["settings"]
    concurrencies = sorted({c for _, c in cells})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in methods_of(result):
        for ax, value in ((left, lambda cell: cell["tokens_per_s"]), (right, lambda cell: cell["tpot_ms"]["p50"])):
            points = [(c, value(cells[m, c])) for c in concurrencies if (m, c) in cells]
            points = [(c, v) for c, v in points if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=m)
    for ax, ylabel in ((left, "aggregate tokens/s"), (right, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    left.set_title("throughput")
    right.set_title("time per output token")
    fig.suptitle(f"service load: {s['requests_per_stream']} requests per stream, {s['max_new_tokens']} new tokens, "
                 f"T={s['temperature']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
