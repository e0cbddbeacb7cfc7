"""What the ingress and the verifier pass each other through Ray (plain, picklable, no torch), and
the rules every message a client or a log sees follows: bounded, no credentials."""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_MESSAGE_CHARS = 512  # an error's details: never an echo of unbounded input


@dataclass(frozen=True)
class VerifyRequest:
    """A validated new request (params set) or a resumption (resume True: the session holds the rest)."""

    session_id: str
    params: dict | None = None  # SamplingParams fields
    prompt_text: str = ""
    prompt_ids: tuple[int, ...] = ()
    tokens_received: int = 0
    resume: bool = False
    stream_interval_ms: int | None = None  # None: the engine's default


@dataclass(frozen=True)
class StreamError:
    """A request that ends in a gRPC error; `code` is a grpc.StatusCode name, `message` names the field."""

    code: str
    message: str


@dataclass(frozen=True)
class MalformedMessage:
    """A request whose bytes did not decode as `message_type` (servicers.py hands it to the handler,
    which answers INVALID_ARGUMENT); `reason` is the decoder's, clipped."""

    message_type: str
    reason: str


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to at most `limit` characters, saying so."""
    return text if len(text) <= limit else text[: limit - 14] + "... (clipped)"


def redact_credentials(text: str) -> str:
    """`text` with the password of every URL in it (scheme://user:password@host) replaced by ***."""
    return re.sub(r"([a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s@/]*@", r"\1***@", text, flags=re.IGNORECASE)


def public_message(text: str) -> str:
    """An error message as a client may see it: credentials redacted, bounded."""
    return clip(redact_credentials(text))
