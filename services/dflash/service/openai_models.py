"""The OpenAI API's requests as pydantic models, what they become (a dflash GenerateRequest), and the
response bodies built from the verifier's GenerateChunks. No torch, no FastAPI here.

What maps: model, prompt (text, or one list of token ids), messages (through the chat template),
max_tokens / max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options.include_usage,
and vLLM's extensions ignore_eos, top_k and stop_token_ids. Fields OpenAI defines that dflash cannot honour
(n > 1, logprobs, tools, penalties, ...) are accepted only at the value that changes nothing; any other
value, and any field OpenAI does not define, is refused naming the field (`unsupported_field`).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..api.v1 import generate_pb2

UInt32 = Annotated[int, Field(ge=0, le=(1 << 32) - 1)]  # what the proto's uint32 fields hold
UInt64 = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]
# OpenAI's defaults where they differ from dflash's (greedy, 128 tokens): sampling at 1, and 16 tokens
# for a completion (a chat completion's max_tokens default is the server's, as OpenAI's is the model's).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_TOKENS = 16

# field -> the values that change nothing (anything else is refused with the reason).
NO_OP_VALUES: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "one choice per request only; send n requests"),
    "best_of": ((None, 1), "one choice per request only"),
    "logprobs": ((None, False, 0), "log probabilities are not returned by this server"),
    "top_logprobs": ((None, 0), "log probabilities are not returned by this server"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "presence_penalty": ((None, 0), "penalties are not supported"),
    "frequency_penalty": ((None, 0), "penalties are not supported"),
    "repetition_penalty": ((None, 1), "penalties are not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "parallel_tool_calls": ((None, False), "tool calling is not supported"),
    "response_format": ((None, {"type": "text"}), "only plain text responses are supported"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints share. Unknown fields are refused (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: UInt32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: UInt64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking: accepted, not used
    ignore_eos: bool = False  # vLLM
    top_k: UInt32 | None = None  # vLLM
    stop_token_ids: list[UInt32] | None = None  # vLLM
    # Defined by OpenAI, honoured only at their no-op value (NO_OP_VALUES).
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_fields(self, default_max_tokens: int | None) -> dict:
        """The GenerateRequest fields for sampling and stopping (the prompt is the endpoint's)."""
        fields: dict = {"temperature": DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
                        "ignore_eos": self.ignore_eos}
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        for name, value in (("max_new_tokens", max_tokens), ("top_p", self.top_p), ("seed", self.seed),
                            ("top_k", self.top_k)):
            if value is not None:
                fields[name] = value
        if self.stop:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.stop_token_ids:
            fields["stop_token_ids"] = self.stop_token_ids
        return fields


class CompletionRequest(_Request):
    """POST /v1/completions. prompt: text, or one list of token ids (a batch of prompts is n > 1)."""

    prompt: str | list[UInt32] | list[str] | list[list[UInt32]]

    def generate_request(self) -> generate_pb2.GenerateRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one (unsupported_field refuses longer ones)
        text = isinstance(prompt, str)
        return generate_pb2.GenerateRequest(prompt=prompt if text else "", prompt_token_ids=[] if text else prompt,
                                            **self.sampling_fields(DEFAULT_COMPLETION_TOKENS))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def template_input(self) -> dict:
        """The message as chat templates read it: role and content text."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages are rendered by the target's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: UInt32 | None = None  # OpenAI's newer name for max_tokens

    def generate_request(self, prompt_token_ids: list[int]) -> generate_pb2.GenerateRequest:
        fields = self.sampling_fields(None)
        if self.max_completion_tokens is not None:
            fields["max_new_tokens"] = self.max_completion_tokens
        return generate_pb2.GenerateRequest(prompt_token_ids=prompt_token_ids, **fields)


def unsupported_field(request: _Request) -> tuple[str, str] | None:
    """(field, why) for the first field set to a value this server cannot honour, or None."""
    for name, (no_ops, why) in NO_OP_VALUES.items():
        value = getattr(request, name)
        if value not in no_ops:
            return name, f"{why} (got {clip_repr(value)})"
    if isinstance(request, CompletionRequest) and isinstance(request.prompt, list) and request.prompt \
            and isinstance(request.prompt[0], str | list) and len(request.prompt) > 1:
        return "prompt", f"one prompt per request only, got {len(request.prompt)}; send one request per prompt"
    if isinstance(request, ChatCompletionRequest) and request.max_tokens is not None \
            and request.max_completion_tokens is not None:
        return "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
    return None


def clip_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- responses -------------------------------------------------------------------------------------


def usage(final: generate_pb2.Final) -> dict:
    p, c = final.usage.prompt_tokens, final.usage.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def finish_reason(final: generate_pb2.Final) -> str:
    return final.finish_reason if final.finish_reason in ("stop", "length") else "stop"


class ResponseShape:
    """The bodies of one response: a completion's or a chat completion's, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, session_id: str) -> None:
        self.chat = chat
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + session_id, "created": int(time.time()),
                     "model": model}

    def whole(self, text: str, final: generate_pb2.Final) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason(final), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion", "choices": [choice],
                "usage": usage(final)}

    def chunk(self, text: str, final: generate_pb2.Final | None, first: bool, include_usage: bool) -> dict:
        choice: dict = {"index": 0, "finish_reason": None if final is None else finish_reason(final),
                        "logprobs": None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        body = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "choices": [choice]}
        if include_usage:
            body["usage"] = None  # OpenAI's shape: null on every chunk, the counts in a last one
        return body

    def usage_chunk(self, final: generate_pb2.Final) -> dict:
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": [],
                "usage": usage(final)}
