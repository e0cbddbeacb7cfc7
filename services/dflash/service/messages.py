"""What the ingress and the verifier pass each other through Ray (plain, picklable, no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyRequest:
    """A validated new request (params set) or a resumption (resume True: the session holds the rest)."""

    session_id: str
    params: dict | None = None  # SamplingParams fields
    prompt_text: str = ""
    prompt_ids: tuple[int, ...] = ()
    tokens_received: int = 0
    resume: bool = False


@dataclass(frozen=True)
class StreamError:
    """A request that ends in a gRPC error; `code` is a grpc.StatusCode name, `message` names the field."""

    code: str
    message: str
