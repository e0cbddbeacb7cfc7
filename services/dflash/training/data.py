"""Training data: JSONL records tokenized with the target's tokenizer, with a loss mask on response tokens.

One record per line, any of:
  {"prompt": "...", "response": "..."}           prompt text continued by the response
  {"prompt_ids": [...], "response_ids": [...]}   exact token ids (what `regenerate` writes)
  {"messages": [{"role": ..., "content": ...}, ...]}   a conversation; the final assistant turn is the
                                                 response, everything before it the prompt
  {"text": "..."}                                plain text; every token counts as response
An optional "id" names the record (default: its line number). A prompt without a response is fine for
regeneration but has nothing to train on. Text is tokenized without special tokens, as the engine
encodes prompts; messages use the tokenizer's chat template when it has one, else "role: content"
lines. A text "response" gets the tokenizer's EOS appended (the target ends its answers with it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import DFlashError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class DataError(DFlashError):
    """A data file is missing or has a malformed record; the message names the line."""


@dataclass(frozen=True)
class Sample:
    """One tokenized sequence. loss_mask[i] is 1 where token i is part of the response."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class Batch:
    """Right-padded sequences. indices: positions of the samples in the dataset (for cached features)."""

    indices: list[int]
    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long, 1 on real tokens
    loss_mask: torch.Tensor  # [B, S] long, 1 on response tokens

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def read_records(path: str | Path) -> list[dict]:
    """Parse a JSONL file; every record gets an "id" (its own, or the line number)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file '{path}' does not exist")
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{number}: each line must be a JSON object")
            if not any(k in record for k in ("prompt", "prompt_ids", "messages", "text")):
                raise DataError(f"{path}:{number}: needs one of 'prompt', 'prompt_ids', 'messages' or 'text'")
            record.setdefault("id", str(number))
            record["id"] = str(record["id"])
            records.append(record)
    if not records:
        raise DataError(f"data file '{path}' holds no records")
    return records


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eval_prompt_ids(path: str | Path, tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[list[int]]:
    """The held-out prompts `dflash train` measures tau on: each prompt's last max_length - 1 tokens, so
    that the anchor fits too."""
    return [prompt_ids(r, tokenizer)[-(max_length - 1):] for r in read_records(path)]


def prompt_ids(record: dict, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids the target is prompted with (what regeneration continues)."""
    if "prompt_ids" in record:
        return [int(t) for t in record["prompt_ids"]]
    if "prompt" in record:
        return encode(tokenizer, _text(record, "prompt"))
    if "messages" in record:
        prompt, _ = _split_conversation(record, tokenizer)
        return encode(tokenizer, prompt)
    raise DataError(f"record {record['id']}: a 'text' record has no prompt to regenerate from; "
                    "use 'prompt' or 'messages'")


def response_ids(record: dict, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The response tokens of a record (empty when it has none)."""
    if "response_ids" in record:
        return [int(t) for t in record["response_ids"]]
    if "response" in record:
        ids = encode(tokenizer, _text(record, "response"))
        eos = getattr(tokenizer, "eos_token_id", None)
        return ids + ([eos] if eos is not None and ids else [])
    if "messages" in record:
        return encode(tokenizer, _split_conversation(record, tokenizer)[1])
    return []


def tokenize(record: dict, tokenizer: PreTrainedTokenizerBase, max_length: int) -> Sample | None:
    """Prompt + response, cut to max_length; None when fewer than 2 response tokens remain."""
    if "text" in record and not any(k in record for k in ("prompt", "prompt_ids", "messages")):
        ids = encode(tokenizer, _text(record, "text"))
        mask = [1] * len(ids)
    else:
        prompt, response = prompt_ids(record, tokenizer), response_ids(record, tokenizer)
        ids, mask = prompt + response, [0] * len(prompt) + [1] * len(response)
    ids, mask = ids[:max_length], mask[:max_length]
    if sum(mask) < 2:
        return None
    return Sample(record["id"], ids, mask)


def load_samples(path: str | Path, tokenizer: PreTrainedTokenizerBase, max_length: int) -> tuple[list[Sample], int]:
    """All trainable samples of a JSONL file and the number of records skipped (no response left)."""
    samples = [tokenize(r, tokenizer, max_length) for r in read_records(path)]
    kept = [s for s in samples if s is not None]
    if not kept:
        raise DataError(
            f"'{path}': no record has a response of at least 2 tokens within max_length {max_length}; "
            "regenerate responses with the target (--regenerate) or raise --max-length"
        )
    return kept, len(samples) - len(kept)


def collate(samples: list[Sample], indices: list[int], pad_id: int) -> Batch:
    length = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), length), dtype=torch.long)
    loss = torch.zeros((len(samples), length), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n] = torch.tensor(s.input_ids)
        attn[row, :n] = 1
        loss[row, :n] = torch.tensor(s.loss_mask)
    return Batch(indices, ids, attn, loss)


def epoch_batches(num_samples: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """A shuffled batch plan; a pure function of (seed, epoch), so a resumed run replays the same order."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_samples, generator=g).tolist()
    return [order[i : i + batch_size] for i in range(0, num_samples, batch_size)]


def _text(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"record {record['id']}: '{key}' must be a string")
    return value


def _split_conversation(record: dict, tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(prompt text, response text): the final assistant turn is the response."""
    messages = record["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"record {record['id']}: 'messages' must be a list of {{role, content}} objects")
    if messages and messages[-1]["role"] == "assistant":
        history, answer = messages[:-1], messages
    else:
        history, answer = messages, None
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        if answer is None:
            return prompt, ""
        full = tokenizer.apply_chat_template(answer, tokenize=False)
        if not full.startswith(prompt):
            raise DataError(
                f"record {record['id']}: the chat template renders the conversation with a different prefix "
                "than its prompt, so the response cannot be located; use prompt/response records"
            )
        return prompt, full[len(prompt) :]
    prompt = "".join(f"{m['role']}: {m.get('content', '')}\n" for m in history) + "assistant: "
    return prompt, "" if answer is None else f"{answer[-1].get('content', '')}\n"
