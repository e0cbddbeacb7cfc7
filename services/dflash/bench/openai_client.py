"""One streamed request to any OpenAI-compatible server (ours, vLLM, SGLang, ...) as a load-sweep Record,
with the official `openai` client. No torch here.

The request is what the gRPC load client sends: the same prompt text, max_tokens, temperature and seed,
and vLLM's `ignore_eos` (so every server generates exactly max_tokens: the same work per cell). The
server's own count of generated tokens comes from `stream_options.include_usage`; the first token is
taken to arrive alone (prefill yields one token, on every server), so TPOT is the time after it over
the tokens after it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import DFlashError
from .load import REQUEST_TIMEOUT_S, Record

if TYPE_CHECKING:
    import openai


class OpenAIClient:
    """A client of the OpenAI-compatible server at `base_url` (".../v1") and the model it serves."""

    def __init__(self, base_url: str, token: str = "", model: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        import openai

        # The client insists on a key; a server without auth ignores the header.
        self.client: openai.OpenAI = openai.OpenAI(base_url=base_url, api_key=token or "none", max_retries=0,
                                                   timeout=timeout_s)
        self.base_url = base_url
        self.model = model or self._served_model()

    def _served_model(self) -> str:
        import openai

        try:
            models = [m.id for m in self.client.models.list()]
        except openai.APIError as exc:
            raise DFlashError(f"--openai {self.base_url}: GET /models failed ({exc})") from None
        if not models:
            raise DFlashError(f"--openai {self.base_url}: the server lists no model")
        return models[0]

    def stream(self, prompt: str, max_new_tokens: int, temperature: float, seed: int,
               deadline: float | None = None, ignore_eos: bool = False) -> Record:
        """Stream one completion; stop listening at `deadline` (perf_counter time) if given."""
        import openai

        rec, text_chunks = Record(), 0
        start = time.perf_counter()
        first_at = last_at = None
        try:
            stream = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos})
            with stream:
                for chunk in stream:
                    now = time.perf_counter()
                    if deadline is not None and now > deadline:
                        break
                    if chunk.usage is not None:
                        rec.completion_tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        if choice.text:
                            text_chunks += 1
                            first_at = first_at or now
                            last_at = now
                        if choice.finish_reason:
                            rec.finished = True
        except openai.APIStatusError as exc:
            rec.error = f"HTTP {exc.status_code}: {exc.message}"
        except openai.APIError as exc:  # connection refused, timeout, an error event mid-stream
            rec.error = f"{type(exc).__name__}: {exc}"
        if rec.completion_tokens is None:  # a server that sends no usage: a token per text chunk, at best
            rec.completion_tokens = text_chunks
        if first_at is not None:
            rec.first_chunk = 1
            rec.ttft_s, rec.decode_s = first_at - start, last_at - first_at
        return rec
