"""The seam between the engine and durable session state: each step's committed rounds, written once.

A service passes a `RoundJournal` (the session store) to the engine; the engine writes every step's
rounds through it, for all the step's sessions at once, before any of them is streamed. So the store
always holds at least what a client has received, and a resumed request can regenerate the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .errors import DFlashError


@dataclass(frozen=True)
class CommittedRound:
    """One session's round in a step: the tokens it committed and the session's round count after it.
    `owner` is the fencing token the session's stream holds (see session_store.py)."""

    session_id: str
    owner: int
    token_ids: list[int]
    num_rounds: int


class SessionFencedError(DFlashError):
    """Another stream took the session over (a resume): this one may no longer commit to it."""


class RoundJournal(Protocol):
    def commit_rounds(self, rounds: list[CommittedRound]) -> set[int]:
        """Write one step's rounds in one round trip; returns the positions in `rounds` of those whose
        session another stream owns now (nothing written for them; a step may hold an old and a new
        stream of one session). Raises DFlashError when the store cannot be reached."""
        ...
