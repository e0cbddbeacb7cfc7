"""Incremental detokenization with stop strings: text is released only once it can no longer change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TRIM = 1024  # characters of settled text kept in the working string before moving it to `_done`


@dataclass(frozen=True)
class TextDelta:
    """New text to emit; `stop_at_token` is the number of tokens to keep when a stop string matched."""

    text: str
    stop_at_token: int | None = None


class TextStream:
    """Decodes a growing list of generated token ids into text deltas.

    Text that could still be the start of a stop string, or that ends in an incomplete UTF-8
    sequence, is held back until the next tokens decide it. When a stop string appears, the
    text before it is released and `stop_at_token` says how many tokens produced it (the token
    that completed the stop string is the last one kept, as vLLM does).

    Decoding is incremental, as in vLLM's detokenizer: only a window of ids is decoded per push,
    the tokens after the last settled point (the read offset) plus the ones that settled before
    it (the prefix), and the new text is what the window adds to the prefix's text. The window
    settles once its text no longer ends in "\\ufffd". `text` is the whole decoded text (cut at
    a matched stop string) and `emitted` the number of its characters already released.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of text already released
        self._reach = max((len(s) for s in stop), default=0)
        # Skipped special tokens decode to nothing, so leaving them out keeps the window short.
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._window: list[int] = []  # ids from the prefix offset on
        self._read = 0  # window[:_read] is the prefix, whose text `_prefix` is already settled
        self._prefix = ""
        self._done: list[str] = []  # text before `_base`, out of reach of any later push
        self._base = 0
        self._recent = ""  # text from `_base` on
        self._stable = 0  # length of the settled text (of all ids before the read offset)
        self._cut: int | None = None  # where a matched stop string cut `text`

    @property
    def text(self) -> str:
        if len(self._done) > 1:
            self._done = ["".join(self._done)]
        text = "".join(self._done) + self._recent
        return text if self._cut is None else text[: self._cut]

    def push(self, new_tokens: list[int]) -> TextDelta:
        first_new = len(self.token_ids)
        self.token_ids.extend(new_tokens)
        self._cut = None
        window, tail = self._extend(self._window, new_tokens)
        self._set_tail(tail)
        hit = self._find_stop() if self.stop else None
        if hit is not None:
            keep, window, tail = self._tokens_to_reach(first_new, hit)
            self.token_ids = self.token_ids[:keep]
            self._set_tail(tail)
        self._settle(window, tail)
        if hit is not None:
            return self._release(hit, stop_at_token=keep)
        text, o = self._recent, self._base
        # Same hold-back rule as always (absolute indices; `_base` stays far enough behind).
        safe = o + len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - n - o : safe - o] == s[:n]:
                    safe = min(safe, o + len(text) - n)
                    break
        return self._release(max(safe, self.emitted))

    def flush(self) -> TextDelta:
        """At the end of generation: everything not yet released (no stop string can complete now)."""
        return self._release(self._base + len(self._recent) if self._cut is None else self._cut)

    def _release(self, upto: int, stop_at_token: int | None = None) -> TextDelta:
        delta = self._recent[self.emitted - self._base : upto - self._base] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        if stop_at_token is not None:
            self._cut = upto
        self._trim()
        return TextDelta(delta, stop_at_token)

    def _extend(self, window: list[int], new_tokens: list[int]) -> tuple[list[int], str]:
        """The window with `new_tokens` added, and the text it adds after the settled text."""
        window = window + [t for t in new_tokens if t not in self._special]
        return window, self._decode(window)[len(self._prefix) :]

    def _set_tail(self, tail: str) -> None:
        self._recent = self._recent[: self._stable - self._base] + tail

    def _settle(self, window: list[int], tail: str) -> None:
        if tail and not tail.endswith("\ufffd"):
            self._window, self._read = window[self._read :], len(window) - self._read
            # Decoded on its own, as the next windows will start with it (decoders may treat a
            # first token differently, e.g. drop its leading space).
            self._prefix = self._decode(self._window[: self._read])
            self._stable += len(tail)
        else:
            self._window = window

    def _trim(self) -> None:
        floor = min(self.emitted, self._stable) - 2 * self._reach - 1
        if floor - self._base > _TRIM:
            self._done.append(self._recent[: floor - self._base])
            self._recent = self._recent[floor - self._base :]
            self._base = floor

    def _find_stop(self) -> int | None:
        # Search only where a stop string could newly appear: from just before released text.
        start = max(0, self.emitted - self._reach) - self._base
        hits = [i for i in (self._recent.find(s, start) for s in self.stop) if i >= 0]
        return self._base + min(hits) if hits else None

    def _tokens_to_reach(self, first_new: int, char_index: int) -> tuple[int, list[int], str]:
        """Fewest tokens whose text covers the stop string starting at char_index (with their window and tail)."""
        # The stop string may start inside settled text: `head` is that part of it.
        head = self._recent[char_index - self._base : self._stable - self._base]
        at = max(0, char_index - self._stable)
        window, tail = self._window, ""
        for n in range(first_new + 1, len(self.token_ids) + 1):
            window, tail = self._extend(window, self.token_ids[n - 1 : n])
            if any((head + tail).startswith(s, at) for s in self.stop):
                return n, window, tail
        return len(self.token_ids), window, tail

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
