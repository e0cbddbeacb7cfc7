"""The load sweep's in-process methods: the same requests, read from an engine in the bench's own
process (its step loop on, one thread per stream, as `engine.generate` users run it), so that what the
serving path keeps of the engine is measured in the same run as the service."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..api.v1 import generate_pb2
from ..params import SamplingParams

if TYPE_CHECKING:
    from ..engine import SpeculativeEngine

PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "block_size", "ignore_eos")


class InProcessClient:
    """Answers `generate(GenerateRequest)` like the gRPC stub, from `engine` (its loop started here)."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        engine.start_loop()

    def generate(self, request: generate_pb2.GenerateRequest, timeout_s: float) -> _Call:
        params = {f: getattr(request, f) for f in PARAMS if f == "ignore_eos" or request.HasField(f)}
        prompt = list(request.prompt_token_ids) or self.engine.encode(request.prompt)
        gen = self.engine.start(prompt, SamplingParams(**params))
        self.engine.submit(gen)
        return _Call(self.engine.stream_batches(gen))


class _Call:
    """A stream of GenerateChunk messages, one per batch of rounds; `cancel()` as a gRPC call has."""

    def __init__(self, batches: Iterator) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[generate_pb2.GenerateChunk]:
        for rounds in self.batches:
            stats = [generate_pb2.RoundStats(index=r.stats.index, draft_tokens=r.stats.draft_tokens,
                                             accepted_tokens=r.stats.accepted_tokens, committed=r.stats.committed,
                                             draft_ms=r.stats.draft_ms, verify_ms=r.stats.verify_ms) for r in rounds]
            chunk = generate_pb2.GenerateChunk(token_ids=[t for r in rounds for t in r.token_ids], rounds=stats)
            if rounds[-1].finish_reason is not None:
                chunk.final.finish_reason = rounds[-1].finish_reason
            yield chunk

    def cancel(self) -> None:
        self.batches.close()
