"""Incremental detokenization with stop strings: text is released only once it can no longer change."""

from __future__ import annotations

from dataclasses import dataclass


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
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of text already released
        self.text = ""

    def push(self, new_tokens: list[int]) -> TextDelta:
        first_new = len(self.token_ids)
        self.token_ids.extend(new_tokens)
        self.text = self._decode(self.token_ids)
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                keep = self._tokens_to_reach(first_new, hit)
                self.token_ids = self.token_ids[:keep]
                return self._release(hit, stop_at_token=keep)
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = len(self.text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, safe), 0, -1):
                if self.text[safe - n : safe] == s[:n]:
                    safe = min(safe, len(self.text) - n)
                    break
        return self._release(max(safe, self.emitted))

    def flush(self) -> TextDelta:
        """At the end of generation: everything not yet released (no stop string can complete now)."""
        return self._release(len(self.text))

    def _release(self, upto: int, stop_at_token: int | None = None) -> TextDelta:
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        if stop_at_token is not None:
            self.text = self.text[:upto]
        return TextDelta(delta, stop_at_token)

    def _find_stop(self) -> int | None:
        # Search only where a stop string could newly appear: from just before released text.
        start = max(0, self.emitted - max(len(s) for s in self.stop))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _tokens_to_reach(self, first_new: int, char_index: int) -> int:
        """Fewest tokens whose text covers the stop string starting at char_index."""
        for n in range(first_new + 1, len(self.token_ids) + 1):
            decoded = self._decode(self.token_ids[:n])
            if any(decoded.find(s, char_index) == char_index for s in self.stop):
                return n
        return len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
