"""Turning a request into a `Generation`: every field checked (an error names it), resumption set up.

The engine's first seam: what comes in from a user (token ids, sampling parameters, a resumed
request's committed tokens and seed) is checked against the target (vocabulary, context length) and
the drafter (trained block size) here, once, before anything is queued.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import InvalidRequestError
from .generation import Generation
from .params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from .scheduler import MAX_STREAM_INTERVAL_MS
from .textstream import TextStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the target's vocabulary and context, the drafter's block (0: none)."""

    vocab_size: int
    max_positions: int
    drafter_block_size: int = 0


def new_generation(
    limits: RequestLimits,
    prompt_ids: Iterable[int],
    params: SamplingParams,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
    request_id: str | None = None,
    committed_ids: list[int] | None = None,
    seed: int | None = None,
    stream_interval_ms: float | None = None,
) -> Generation:
    """A checked request's state (not yet queued); InvalidRequestError naming the field otherwise.

    With `committed_ids` and the `seed` a request used, it continues exactly where it stopped: the
    committed tokens are prefilled with the prompt and their text counts as already streamed.
    `stream_interval_ms` overrides the engine's stream interval for this request (0: every round).
    """
    if stream_interval_ms is not None and not 0 <= stream_interval_ms <= MAX_STREAM_INTERVAL_MS:
        raise InvalidRequestError("stream_interval_ms", f"must be between 0 and {MAX_STREAM_INTERVAL_MS}, "
                                  f"got {stream_interval_ms}")
    prompt = check_prompt(limits, prompt_ids)
    params = fit_context(limits, len(prompt), params)
    block_size = check_block_size(limits, params)
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop", "stop strings need a tokenizer; pass stop_token_ids instead")
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
    gen = Generation(
        request_id=request_id or uuid.uuid4().hex,
        prompt_ids=prompt,
        params=params,
        block_size=block_size,
        stop_token_ids=stops,
        text=TextStream(tokenizer, params.stop) if tokenizer is not None else None,
    )
    if seed is not None or params.seed is not None:
        gen.seed = seed if seed is not None else params.seed
    gen.stats.prompt_tokens = len(prompt)
    if committed_ids:
        if len(committed_ids) >= params.max_new_tokens:
            raise InvalidRequestError("committed_ids", "the request already has all its tokens")
        gen.output_ids = [int(t) for t in committed_ids]
        if gen.text is not None:
            gen.text.push(gen.output_ids)
            gen.text.emitted = len(gen.text.text)  # already streamed before the interruption
    gen.prefill_ids = gen.prompt_ids + gen.output_ids[:-1]
    if stream_interval_ms is not None:
        gen.stream_interval_s = stream_interval_ms / 1000
    return gen


def check_prompt(limits: RequestLimits, prompt_ids: Iterable[int]) -> list[int]:
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise InvalidRequestError("prompt", "is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {limits.vocab_size})")
    if len(ids) >= limits.max_positions:
        raise InvalidRequestError(
            "prompt",
            f"is {len(ids)} tokens; the model's context holds {limits.max_positions} "
            "(prompt plus at least one new token): shorten the prompt",
        )
    return ids


def fit_context(limits: RequestLimits, prompt_tokens: int, params: SamplingParams) -> SamplingParams:
    """`params` with max_new_tokens resolved: unset, DEFAULT_MAX_NEW_TOKENS or the room the context
    leaves, whichever is fewer; set, refused when prompt + max_new_tokens exceed the context (as vLLM
    and the OpenAI API answer 400), never cut short silently."""
    room = limits.max_positions - prompt_tokens
    if params.max_new_tokens is None:
        return replace(params, max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, room))
    if params.max_new_tokens > room:
        raise InvalidRequestError(
            "max_new_tokens",
            f"{params.max_new_tokens} does not fit: the model's context holds {limits.max_positions} tokens and "
            f"the prompt is {prompt_tokens}, so at most {room} new tokens (or leave max_new_tokens unset)",
        )
    return params


def check_block_size(limits: RequestLimits, params: SamplingParams) -> int:
    if not limits.drafter_block_size:
        if params.block_size not in (None, 1):
            raise InvalidRequestError("block_size", f"{params.block_size} needs a drafter; none is loaded (use 1)")
        return 1
    size = params.block_size or limits.drafter_block_size
    if size > limits.drafter_block_size:
        raise InvalidRequestError("block_size",
                                  f"{size} exceeds the drafter's trained block size {limits.drafter_block_size}")
    return size
