"""The wire format of tensors: `{dtype, shape, data}` with raw little-endian bytes, sliced into chunks.

The only module that turns tensors into bytes and back, and Draft calls into messages and back.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..api.internal.v1 import drafter_pb2
from ..drafter.protocol import GREEDY, DraftRequest, DraftSampling
from ..errors import DFlashError

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}
NAMES = {v: k for k, v in DTYPES.items()}


class CodecError(DFlashError):
    """Bytes that do not describe the tensor they claim to."""


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def from_parts(dtype: str, shape: Iterable[int], data: bytes) -> torch.Tensor:
    """CodecError, never anything else, for parts that do not make a tensor (the caller's bytes)."""
    if dtype not in DTYPES:
        raise CodecError(f"unknown tensor dtype {dtype[:32]!r}; known: {', '.join(DTYPES)}")
    shape = tuple(int(s) for s in shape)
    kind = DTYPES[dtype]
    expected = kind.itemsize
    for s in shape:
        expected *= s
    if len(shape) > 8 or any(s >= 1 << 62 for s in shape):
        raise CodecError(f"tensor shape: {len(shape)} dimensions, largest {max(shape)}: not a context tensor")
    if len(data) != expected:
        raise CodecError(f"tensor {dtype}{list(shape)} needs {expected} bytes, got {len(data)}")
    try:
        if not data:
            return torch.empty(shape, dtype=kind)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)
    except (RuntimeError, ValueError, OverflowError) as exc:
        raise CodecError(f"tensor {dtype}{list(shape)}: {str(exc)[:120]}") from None


def draft_request_chunks(
    session_id: str, context: torch.Tensor, context_start: int, last_token: int, block_size: int, chunk_bytes: int,
    sampling: DraftSampling = GREEDY, restart: bool = False,
) -> Iterator[drafter_pb2.DraftRequestChunk]:
    """One session's part of a Draft stream: header + dtype/shape first, the context's bytes in slices."""
    data = tensor_bytes(context)
    head = drafter_pb2.DraftRequestChunk(
        session_id=session_id, context_start=context_start, last_token=last_token, block_size=block_size,
        min_confidence=sampling.min_confidence, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, seed=sampling.seed, restart=restart,
        context=drafter_pb2.Tensor(dtype=NAMES[context.dtype], shape=list(context.shape), data=data[:chunk_bytes]),
    )
    yield head
    for offset in range(chunk_bytes, len(data), chunk_bytes):
        yield drafter_pb2.DraftRequestChunk(context=drafter_pb2.Tensor(data=data[offset : offset + chunk_bytes]))


def draft_batch_chunks(requests: Iterable[DraftRequest], chunk_bytes: int) -> Iterator[drafter_pb2.DraftRequestChunk]:
    """A DraftBatch stream: every request's chunks in turn."""
    for r in requests:
        yield from draft_request_chunks(r.session_id, r.context, r.context_start, r.last_token, r.block_size,
                                        chunk_bytes, r.sampling, r.restart)


def draft_sampling(head: drafter_pb2.DraftRequestChunk) -> DraftSampling:
    """The header's proposal rule; a value out of range raises DFlashError naming the field."""
    return DraftSampling(temperature=head.temperature, top_k=head.top_k, top_p=head.top_p, seed=head.seed,
                         min_confidence=head.min_confidence)


def join_draft_batch(chunks: Iterable[drafter_pb2.DraftRequestChunk]) -> list[DraftRequest]:
    """Reassemble a DraftBatch (or Draft) stream into requests; a chunk with a session_id starts the next.
    CodecError for an empty stream, a headerless first chunk or bytes that do not fit their shape."""
    heads: list[drafter_pb2.DraftRequestChunk] = []
    parts: list[list[bytes]] = []
    for chunk in chunks:
        if chunk.session_id:
            heads.append(chunk)
            parts.append([])
        elif not heads:
            raise CodecError("the Draft stream's first message has no session_id")
        parts[-1].append(chunk.context.data)
    if not heads:
        raise CodecError("empty Draft stream")
    return [
        DraftRequest(h.session_id, from_parts(h.context.dtype, h.context.shape, b"".join(p)), h.context_start,
                     h.last_token, h.block_size, draft_sampling(h), h.restart)
        for h, p in zip(heads, parts)
    ]
