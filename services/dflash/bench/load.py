"""Service load mode: N concurrent streaming gRPC clients for a fixed time, and the one-request client.

No torch here: this is a plain gRPC client of the public `dflash.v1.Generation` API.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import DFlashError

CONNECT_TIMEOUT_S = 5.0


class Client:
    """A `Generation` stub and the call metadata (a bearer token when the service has auth on)."""

    def __init__(self, stub, token: str = ""):
        self.stub = stub
        self.metadata = [("authorization", f"Bearer {token}")] if token else []

    def generate(self, request, timeout_s: float):
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
    committed: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    finished: bool = False
    error: str | None = None  # the gRPC status code name, with details

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_ids) - self.first_chunk
        return self.decode_s / n if self.finished and n > 0 else None


def make_request(prompt, max_new_tokens, temperature, seed, block_size):
    """A GenerateRequest; `prompt` is text (the server encodes it) or a list of token ids."""
    from ..api.v1 import generate_pb2

    text = isinstance(prompt, str)
    kwargs = dict(prompt=prompt if text else "", prompt_token_ids=[] if text else list(prompt),
                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    if block_size is not None:
        kwargs["block_size"] = block_size
    return generate_pb2.GenerateRequest(**kwargs)


def stream_request(client: Client, prompt_ids, max_new_tokens, temperature, seed, block_size=None, timeout_s=600.0,
                   deadline: float | None = None) -> Record:
    """Stream one `Generate` call; stop listening (cancel) at `deadline` (perf_counter time) if given."""
    import grpc

    rec = Record()
    start = time.perf_counter()
    first_at = last_at = None
    call = client.generate(make_request(prompt_ids, max_new_tokens, temperature, seed, block_size), timeout_s)
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
            if chunk.HasField("round") and chunk.round.index > 0:
                rec.committed.append(chunk.round.committed)
                rec.draft_s += chunk.round.draft_ms / 1000
                rec.verify_s += chunk.round.verify_ms / 1000
            if chunk.HasField("final"):
                rec.finished = True
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            rec.error = f"{exc.code().name}: {exc.details()}"
    if first_at is not None:
        rec.ttft_s, rec.decode_s = first_at - start, last_at - first_at
    return rec


@dataclass(frozen=True)
class LoadSettings:
    address: str
    clients: int
    duration_s: float
    max_new_tokens: int = 128
    temperature: float = 0.0
    block_size: int | None = None
    token: str = ""


def run_load(settings: LoadSettings, prompts: list) -> dict:
    """Run `clients` threads, each sending one streaming request after another until the time is up.

    Tokens count while they arrive inside the window; requests still streaming at the end are
    cancelled (their TTFT counts if they got a first token, their TPOT does not).
    """
    if not prompts:
        raise DFlashError("the load mode needs at least one prompt")
    client = connect(settings.address, settings.token)
    records: list[Record] = []
    lock = threading.Lock()
    start = time.perf_counter()
    deadline = start + settings.duration_s

    def worker(k: int) -> None:
        i = k
        while time.perf_counter() < deadline:
            try:
                rec = stream_request(client, prompts[i % len(prompts)], settings.max_new_tokens,
                                     settings.temperature, seed=i, block_size=settings.block_size, deadline=deadline)
            except Exception as exc:  # a client bug must show up in the result, not vanish with its thread
                rec = Record(error=f"CLIENT: {type(exc).__name__}: {exc}")
            with lock:
                records.append(rec)
            i += settings.clients

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(settings.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize_load(settings, records, time.perf_counter() - start)


def summarize_load(settings: LoadSettings, records: list[Record], wall_s: float) -> dict:
    ttft = [r.ttft_s * 1000 for r in records if r.first_chunk]
    tpot = [r.tpot_s * 1000 for r in records if r.tpot_s is not None]
    errors = Counter(r.error.split(":")[0] for r in records if r.error)
    tokens = sum(len(r.token_ids) for r in records)
    return {
        "address": settings.address, "clients": settings.clients, "duration_s": round(wall_s, 3),
        "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
        "requests": len(records), "completed": sum(r.finished for r in records),
        "errors": dict(errors), "error_examples": sorted({r.error for r in records if r.error})[:5],
        "tokens": tokens, "tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tpot_ms": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
    }


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 3)


def format_load(result: dict) -> str:
    t, p = result["ttft_ms"], result["tpot_ms"]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    lines = [
        "| clients | requests (done) | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors |",
        "|---|---|---|---|---|---|",
        (f"| {result['clients']} | {result['requests']} ({result['completed']}) | {result['tokens_per_s']:.1f} "
         f"| {fmt(t['p50'])} / {fmt(t['p99'])} | {fmt(p['p50'])} / {fmt(p['p99'])} "
         f"| {sum(result['errors'].values()) or 0} {result['errors'] or ''} |"),
    ]
    return "\n".join(lines)
