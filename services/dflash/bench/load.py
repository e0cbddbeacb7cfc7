"""Service load mode: a sweep over concurrencies, DFlash beside target only through one running
service (and any OpenAI-compatible servers beside it), a fixed amount of work per cell; and the
one-request streaming client it is built on.

No torch here: this is a plain gRPC client of the public `dflash.v1.Generation` API (openai_client.py
is the OpenAI API's).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from ..errors import DFlashError

if TYPE_CHECKING:
    from ..api.v1 import generate_pb2, generate_pb2_grpc
    from .openai_client import OpenAIClient

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 600.0


class Client:
    """A `Generation` stub and the call metadata (a bearer token when the service has auth on)."""

    def __init__(self, stub: generate_pb2_grpc.GenerationStub, token: str = "") -> None:
        self.stub = stub
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    def generate(self, request: generate_pb2.GenerateRequest,
                 timeout_s: float) -> Iterator[generate_pb2.GenerateChunk]:
        return self.stub.Generate(request, metadata=self.metadata, timeout=timeout_s)


def connect(address: str, token: str = "", timeout_s: float = CONNECT_TIMEOUT_S) -> Client:
    """A client of the service at `address` (host:port); DFlashError when nothing answers there."""
    import grpc

    from ..api.v1 import generate_pb2_grpc

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise DFlashError(f"no gRPC service answers at {address} (start one with `dflash serve`)") from None
    return Client(generate_pb2_grpc.GenerationStub(channel), token)


@dataclass
class Record:
    """One streamed request as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    first_chunk: int = 0
    committed: list[int] = field(default_factory=list)  # per verify round (the prefill round left out)
    draft_s: float = 0.0
    verify_s: float = 0.0
    finished: bool = False
    error: str | None = None  # the gRPC status code name, with details
    completion_tokens: int | None = None  # the server's count, when the client sees text, not ids (OpenAI API)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.completion_tokens is None else self.completion_tokens

    @property
    def tpot_s(self) -> float | None:
        n = self.num_tokens - self.first_chunk
        return self.decode_s / n if self.finished and n > 0 else None


def make_request(prompt: str | Sequence[int], max_new_tokens: int, temperature: float, seed: int,
                 block_size: int | None, ignore_eos: bool = False) -> generate_pb2.GenerateRequest:
    """A GenerateRequest; `prompt` is text (the server encodes it) or a list of token ids; `block_size`
    None leaves the field unset (the service's default block), 1 runs the target alone."""
    from ..api.v1 import generate_pb2

    text = isinstance(prompt, str)
    kwargs = dict(prompt=prompt if text else "", prompt_token_ids=[] if text else list(prompt),
                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
    if block_size is not None:
        kwargs["block_size"] = block_size
    return generate_pb2.GenerateRequest(**kwargs)


def stream_request(client: Client, prompt_ids: str | Sequence[int], max_new_tokens: int, temperature: float,
                   seed: int, block_size: int | None = None, timeout_s: float = REQUEST_TIMEOUT_S,
                   deadline: float | None = None, ignore_eos: bool = False) -> Record:
    """Stream one `Generate` call; stop listening (cancel) at `deadline` (perf_counter time) if given."""
    import grpc

    rec = Record()
    start = time.perf_counter()
    first_at = last_at = None
    call = client.generate(make_request(prompt_ids, max_new_tokens, temperature, seed, block_size, ignore_eos),
                           timeout_s)
    try:
        for chunk in call:
            now = time.perf_counter()
            if deadline is not None and now > deadline:
                call.cancel()
                break
            if chunk.token_ids:
                if first_at is None:
                    first_at, rec.first_chunk = now, len(chunk.token_ids)
                last_at = now
                rec.token_ids += list(chunk.token_ids)
            for r in chunk.rounds or ([chunk.round] if chunk.HasField("round") else []):  # several when coalesced
                if r.index > 0:
                    rec.committed.append(r.committed)
                    rec.draft_s += r.draft_ms / 1000
                    rec.verify_s += r.verify_ms / 1000
            if chunk.HasField("final"):
                rec.finished = True
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            rec.error = f"{exc.code().name}: {exc.details()}"
    if first_at is not None:
        rec.ttft_s, rec.decode_s = first_at - start, last_at - first_at
    return rec


# -- the sweep -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadMethod:
    """What one method puts in the request: `block_size` None leaves it unset (the service's default).
    With `openai_url` (".../v1"), the request goes to that OpenAI-compatible server instead."""

    name: str
    block_size: int | None
    openai_url: str = ""
    in_process: bool = False  # through an engine in this process (bench/inprocess_client.py), not a server


METHODS = (LoadMethod("dflash", None), LoadMethod("target-only", 1))


@dataclass(frozen=True)
class SweepSettings:
    """One sweep: at each concurrency c, each method runs c streams of `requests_per_stream` requests."""

    address: str  # the gRPC service ("" when every method is an OpenAI-compatible server)
    concurrencies: tuple[int, ...]
    requests_per_stream: int = 2
    max_new_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = True  # every request then generates exactly max_new_tokens: the same work per cell
    duration_s: float | None = None  # a cap per cell: no request starts after it, those streaming are cancelled
    warmup_requests: int = 1  # per method, before the sweep, not counted
    passes: int = 1  # the whole sweep this many times; cells and ratios are then medians over the passes
    methods: tuple[LoadMethod, ...] = METHODS
    token: str = field(default="", repr=False)
    openai_token: str = field(default="", repr=False)  # the OpenAI servers' API key ("": token)
    in_process: object = field(default=None, repr=False)  # the in-process methods' client (InProcessClient)

    def public(self) -> dict:
        """The settings as written to load.json (no tokens)."""
        d = asdict(replace(self, in_process=None))  # an engine is not settings (nor copyable)
        del d["token"], d["openai_token"], d["in_process"]
        return d


def parse_concurrencies(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4): distinct, ascending; DFlashError for anything but positive integers."""
    try:
        values = {int(v) for v in str(text).split(",") if v.strip()}
    except ValueError:
        raise DFlashError(f"--load: expected concurrencies like 1,2,4,8, got {text!r}") from None
    if not values or min(values) <= 0:
        raise DFlashError(f"--load: concurrencies must be positive integers, got {text!r}")
    return tuple(sorted(values))


def run_sweep(settings: SweepSettings, prompts: list, progress: Callable[[dict], None] | None = None) -> dict:
    """Every (concurrency, method) cell, the methods interleaved at each concurrency so that drift in
    the machine's speed hits both alike, their order alternating from one concurrency to the next (A B,
    B A, ...) so that neither always meets a new concurrency first (the server adapts to it: the verify
    policy learns the batch's costs); `progress(cell)` is called as each cell finishes. With
    `settings.passes` > 1 the whole sweep runs that many times (`merge_passes`)."""
    if not prompts:
        raise DFlashError("the load mode needs at least one prompt")
    if settings.passes < 1:
        raise DFlashError(f"--passes: at least 1 pass over the sweep, got {settings.passes}")
    clients = connect_all(settings)
    for method in settings.methods:
        for i in range(settings.warmup_requests):
            _one(clients[method.name], settings, method, prompts[i % len(prompts)], i, None)
    passes = []
    for n in range(settings.passes):  # each pass starts with the other method: every pair meets both orders
        cells = []
        for k, concurrency in enumerate(settings.concurrencies):
            for method in settings.methods if (k + n) % 2 == 0 else settings.methods[::-1]:
                records, wall_s = run_cell(clients[method.name], settings, method, concurrency, prompts)
                cells.append(summarize_cell(method.name, concurrency, records, wall_s))
                if progress is not None:
                    progress(cells[-1])
        add_speedups(cells)
        passes.append(cells)
    if len(passes) == 1:
        return {"settings": settings.public(), "cells": passes[0], "ratios": method_ratios(passes[0], settings.methods)}
    return {"settings": settings.public(), **merge_passes(passes, settings.methods)}


def merge_passes(passes: list[list[dict]], methods: tuple[LoadMethod, ...] = METHODS) -> dict:
    """Several passes of one sweep as one result: each cell is its median pass by tokens/s (the lower
    of the middle two for an even count, so every figure of a cell comes from one real run), with the
    tokens/s of every pass; each ratio is the median of the passes' own ratios (both sides measured in
    the same pass, minutes apart at most, so the machine's drift cancels within each); `passes` keeps
    every pass's cells."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for cells in passes:
        for cell in cells:
            runs.setdefault((cell["method"], cell["concurrency"]), []).append(cell)
    merged = []
    for cells in runs.values():
        median = statistics.median_low(c["tokens_per_s"] for c in cells)
        cell = next(c for c in cells if c["tokens_per_s"] == median)
        merged.append({**cell, "tokens_per_s_passes": [c["tokens_per_s"] for c in cells]})
    add_speedups(merged)
    per_pass = [method_ratios(cells, methods) for cells in passes]
    ratios = {name: {c: _median([r[name][c] for r in per_pass]) for c in by_c} for name, by_c in per_pass[0].items()}
    return {"cells": merged, "ratios": ratios, "passes": passes}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def connect_all(settings: SweepSettings) -> dict[str, Client | OpenAIClient]:
    """A client per method: one gRPC client shared by the service's methods, one per OpenAI server."""
    from .openai_client import OpenAIClient

    grpc_client = None
    clients: dict[str, Client | OpenAIClient] = {}
    for method in settings.methods:
        if method.in_process:
            clients[method.name] = settings.in_process
        elif method.openai_url:
            clients[method.name] = OpenAIClient(method.openai_url, settings.openai_token or settings.token)
        else:
            grpc_client = grpc_client or connect(settings.address, settings.token)
            clients[method.name] = grpc_client
    return clients


def run_cell(client: Client | OpenAIClient, settings: SweepSettings, method: LoadMethod, concurrency: int,
             prompts: list) -> tuple[list[Record], float]:
    """`concurrency` streams, each sending `requests_per_stream` requests one after another; stream k's
    j-th request is request r = j * concurrency + k: prompt r (cycling), seed r. Returns the records and
    the cell's wall time, from the common start to the end of the last stream."""
    starts: list[float] = []
    barrier = threading.Barrier(concurrency, action=lambda: starts.append(time.perf_counter()))
    records: list[list[Record]] = [[] for _ in range(concurrency)]
    ends = [0.0] * concurrency

    def stream(k: int) -> None:
        barrier.wait()
        deadline = starts[0] + settings.duration_s if settings.duration_s else None
        for j in range(settings.requests_per_stream):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            r = j * concurrency + k
            records[k].append(_one(client, settings, method, prompts[r % len(prompts)], r, deadline))
        ends[k] = time.perf_counter()

    threads = [threading.Thread(target=stream, args=(k,), daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for rs in records for r in rs], max(ends) - starts[0]


def _one(client: Client | OpenAIClient, settings: SweepSettings, method: LoadMethod, prompt: str | Sequence[int],
         seed: int, deadline: float | None) -> Record:
    try:
        if method.openai_url:
            return client.stream(prompt, settings.max_new_tokens, settings.temperature, seed, deadline,
                                 settings.ignore_eos)
        return stream_request(client, prompt, settings.max_new_tokens, settings.temperature, seed,
                              method.block_size, deadline=deadline, ignore_eos=settings.ignore_eos)
    except Exception as exc:  # a client bug must show up in the result, not vanish with its thread
        return Record(error=f"CLIENT: {type(exc).__name__}: {exc}")


def summarize_cell(method: str, concurrency: int, records: list[Record], wall_s: float) -> dict:
    """A cell's numbers: aggregate tokens/s = all generated tokens / the cell's wall time; TTFT and TPOT
    (decode time per token after the first chunk) percentiles over requests; tau = committed tokens per
    verify round over all the cell's rounds."""
    ttft = [r.ttft_s * 1000 for r in records if r.first_chunk]
    tpot = [r.tpot_s * 1000 for r in records if r.tpot_s is not None]
    committed = [n for r in records for n in r.committed]
    errors = [r.error for r in records if r.error]
    tokens = sum(r.num_tokens for r in records)
    return {
        "method": method, "concurrency": concurrency, "wall_s": round(wall_s, 4),
        "requests": len(records), "completed": sum(r.finished for r in records),
        "errors": len(errors), "error_codes": dict(Counter(e.split(":")[0] for e in errors)),
        "error_examples": sorted(set(errors))[:5],
        "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tpot_ms": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        "tau": round(sum(committed) / len(committed), 3) if committed else None,
        "speedup_vs_c1": None,
    }


def add_speedups(cells: list[dict]) -> None:
    """Each cell's aggregate tokens/s over its method's at concurrency 1 (the sequential baseline);
    stays None when the sweep has no c=1 cell or that cell made nothing."""
    base = {c["method"]: c["tokens_per_s"] for c in cells if c["concurrency"] == 1}
    for c in cells:
        b = base.get(c["method"])
        c["speedup_vs_c1"] = round(c["tokens_per_s"] / b, 3) if b else None


def method_ratios(cells: list[dict], methods: tuple[LoadMethod, ...] = METHODS) -> dict[str, dict[str, float | None]]:
    """{"dflash/target-only": {"<c>": ratio of aggregate tokens/s}}: the first method over each other one."""
    rate = {(c["method"], c["concurrency"]): c["tokens_per_s"] for c in cells}
    first = methods[0].name
    concurrencies = sorted({c for _, c in rate})
    ratios = {f"{first}/{m.name}": {str(c): _ratio(rate.get((first, c)), rate.get((m.name, c))) for c in concurrencies}
              for m in methods[1:] if not m.in_process}
    for m in methods:  # each service method over the same method in process: what the serving path keeps
        if m.in_process:
            served = m.name.removeprefix("in-process ")
            ratios[f"{served}/{m.name}"] = {str(c): _ratio(rate.get((served, c)), rate.get((m.name, c)))
                                            for c in concurrencies}
    return ratios


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 3)
