"""The serving path in process: how much of what the model computes reaches the streams.

Three ways to run the same N prompts (greedy, a fixed number of new tokens each, EOS ignored), side by
side in one process:
  static      transformers' `generate()` on one left-padded batch of the N prompts (target only)
  driven      the engine's own steps, driven in one thread (no stream reads them)
  streams     the engine's step loop running, N threads each reading its `engine.generate` stream
The engine runs are made for target-only (block 1) and DFlash (the drafter's block, the engine's verify
policy). What one would serve is `streams`; `driven` is its ceiling and `static` the yardstick.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from ..engine import SpeculativeEngine
from ..params import SamplingParams


@dataclass(frozen=True)
class Cell:
    way: str
    method: str
    streams: int
    tokens: int
    seconds: float
    ttft_ms: float | None = None
    tau: float | None = None
    pass_index: int = 0  # which pass of the sweep (streams cells; see sweep)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def to_dict(self) -> dict:
        return {**asdict(self), "tok_s": round(self.tok_s, 1)}


def static_batch(engine: SpeculativeEngine, prompts: Sequence[list[int]], max_new_tokens: int) -> Cell:
    """`generate()` of the target on one left-padded batch: every row makes max_new_tokens tokens."""
    model = engine.target.model
    width = max(len(p) for p in prompts)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=engine.target.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=engine.target.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    seconds = time.perf_counter() - t0
    return Cell("static", "target-only", len(prompts), (out.shape[1] - width) * len(prompts), seconds)


def driven(engine: SpeculativeEngine, prompts: Sequence[list[int]], params: SamplingParams, method: str) -> Cell:
    """Every request submitted, then steps run in this thread until all are done (no loop thread)."""
    if engine._loop is not None:
        raise RuntimeError("driven: the engine's step loop is already running")
    gens = [engine.start(p, params) for p in prompts]
    t0 = time.perf_counter()
    for g in gens:
        engine.submit(g)
    while engine.step():
        pass
    seconds = time.perf_counter() - t0
    return Cell("driven", method, len(prompts), sum(len(g.output_ids) for g in gens), seconds,
                tau=_tau([g.stats for g in gens]))


def streams(engine: SpeculativeEngine, prompts: Sequence[list[int]], params: SamplingParams, method: str,
            requests_per_stream: int = 1) -> Cell:
    """The step loop on (started here if it is not), one thread per stream reading its requests' streams
    one after another: stream i runs prompts i, i + n, i + 2n, ... (n streams, `requests_per_stream`
    each, so `prompts` holds n * requests_per_stream); TTFT is each stream's first request's."""
    engine.start_loop()
    n = len(prompts) // requests_per_stream
    tokens = [0] * n
    ttft = [0.0] * n
    totals: list = [None] * len(prompts)
    start = threading.Barrier(n + 1)

    def read(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        for k in range(requests_per_stream):
            for out in engine.generate(prompts[i + k * n], params):
                if not tokens[i] and out.token_ids:
                    ttft[i] = time.perf_counter() - t0
                tokens[i] += len(out.token_ids)
                totals[i + k * n] = out.totals

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    return Cell("streams", method, n, sum(tokens), seconds,
                ttft_ms=sorted(ttft)[len(ttft) // 2] * 1000, tau=_tau(totals))


def _tau(totals: Sequence) -> float | None:
    rounds = sum(t.rounds for t in totals if t is not None)
    return sum(t.generated_tokens - 1 for t in totals if t is not None) / rounds if rounds else None


def sweep(engines: dict[str, SpeculativeEngine], prompts: Sequence[list[int]], concurrencies: Sequence[int],
          max_new_tokens: int, passes: int = 1, requests_per_stream: int = 1) -> list[Cell]:
    """Each way at each concurrency (the last `c` prompts; the streams runs take the last
    `c * requests_per_stream`, each stream running its requests one after another): target-only on the
    first engine, DFlash on each (`engines`: verify policy name -> engine); one warm-up first. The
    loop-thread runs come last, as the loop cannot be stopped once started; they are made `passes`
    times, the methods' order reversed every other pass, so that a machine slowing down or speeding up
    within the run does not favour the method that runs first (this machine drifts 10-30% between minutes)."""
    first = next(iter(engines.values()))
    plain = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, block_size=1)
    spec = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    methods = [("target-only", first, plain)]
    methods += [(f"dflash {name}", e, spec) for name, e in engines.items() if e.drafter is not None]
    for _, engine, params in methods[1:]:
        driven(engine, prompts[:2], params, "warm-up")
    cells = []
    for c in concurrencies:
        batch = list(prompts[-c:])
        cells.append(static_batch(first, batch, max_new_tokens))
        cells += [driven(engine, batch, params, name) for name, engine, params in methods]
    for index in range(passes):
        for c in concurrencies:
            batch = list(prompts[-c * requests_per_stream:])
            order = methods if index % 2 == 0 else methods[::-1]
            cells += [replace(streams(engine, batch, params, name, requests_per_stream), pass_index=index)
                      for name, engine, params in order]
    return cells


def format_cells(cells: Sequence[Cell]) -> str:
    """A table: tok/s per way, and streams as a fraction of static and of driven, per concurrency (with
    several passes, the streams cell is the median pass's figures)."""
    by = {(c.way, c.method, c.streams): c for c in cells if c.way != "streams"}
    runs: dict[tuple[str, int], list[Cell]] = {}
    for c in cells:
        if c.way == "streams":
            runs.setdefault((c.method, c.streams), []).append(c)
    lines = ["| streams | method | static tok/s | driven tok/s | streams tok/s | streams/static | streams/driven "
             "| TTFT p50 ms | tau |", "|---|---|---|---|---|---|---|---|---|"]
    for (method, n), passes in runs.items():
        static, drive = by[("static", "target-only", n)], by[("driven", method, n)]
        tok_s, ttft, tau = (_median([getattr(c, k) or 0 for c in passes]) for k in ("tok_s", "ttft_ms", "tau"))
        lines.append(f"| {n} | {method} | {static.tok_s:.0f} | {drive.tok_s:.0f} | {tok_s:.0f} | "
                     f"{tok_s / static.tok_s:.2f} | {tok_s / drive.tok_s:.2f} | {ttft:.1f} | {tau:.2f} |")
    return "\n".join(lines)


def format_policy(cells: Sequence[Cell], method: str = "dflash adaptive") -> str:
    """`method`'s streams against the best of the other methods run beside it, and against target-only,
    per concurrency: each pass's own ratio (the cells of one pass ran a minute apart at most), their
    median and range."""
    runs: dict[int, list[dict[str, float]]] = {}
    for c in cells:
        if c.way == "streams":
            by_pass = runs.setdefault(c.streams, [])
            while len(by_pass) <= c.pass_index:
                by_pass.append({})
            by_pass[c.pass_index][c.method] = c.tok_s
    lines = [f"| streams | {method} / best other | range | / target-only | range |", "|---|---|---|---|---|"]
    for n, passes in runs.items():
        passes = [p for p in passes if method in p and "target-only" in p and len(p) > 1]
        if not passes:
            continue
        best = [p[method] / max(v for k, v in p.items() if k != method) for p in passes]
        alone = [p[method] / p["target-only"] for p in passes]
        lines.append(f"| {n} | {_median(best):.2f} | {min(best):.2f}-{max(best):.2f} | {_median(alone):.2f} | "
                     f"{min(alone):.2f}-{max(alone):.2f} |")
    return "\n".join(lines)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
