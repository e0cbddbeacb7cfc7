"""Stage 1 (optional): regenerate every response with the target itself, so the drafter learns to
imitate the target rather than whoever wrote the dataset.

Output JSONL (one line per record, written and flushed as each batch finishes):
    {"id", "prompt_ids", "response_ids", "response"} plus the record's own "prompt"/"messages".
Resumable: ids already in the output are skipped; a torn last line from a killed run is dropped.
Batches are left-padded (decoder-only generate) and grouped by prompt length to waste little padding.
Sampling (temperature > 0) seeds each batch from `seed` and the batch's first record id.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from .data import DataError, prompt_ids, read_records

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def regenerate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data_path: str | Path,
    out_path: str | Path,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 8,
    seed: int = 0,
    max_prompt_tokens: int | None = None,
) -> Path:
    """Write target responses for every prompt of `data_path` to `out_path`; returns out_path."""
    out_path = Path(out_path)
    done = _written_ids(out_path)
    pending = []
    for record in read_records(data_path):
        if record["id"] in done:
            continue
        ids = prompt_ids(record, tokenizer)
        if max_prompt_tokens is not None:
            ids = ids[-max_prompt_tokens:]
        if not ids:
            raise DataError(f"record {record['id']}: empty prompt")
        pending.append((record, ids))
    pending.sort(key=lambda item: len(item[1]))
    pad_id = _pad_id(tokenizer, model)
    eos = _eos_ids(model, tokenizer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("a", encoding="utf-8") as out, tqdm(
        total=len(done) + len(pending), initial=len(done), desc="regenerating responses", unit="prompt"
    ) as bar:
        for start in range(0, len(pending), batch_size):
            chunk = pending[start : start + batch_size]
            responses = _generate(model, [ids for _, ids in chunk], pad_id, eos, max_new_tokens, temperature,
                                  seed + zlib.crc32(chunk[0][0]["id"].encode()))
            for (record, ids), response in zip(chunk, responses):
                line = {k: v for k, v in record.items() if k in ("id", "prompt", "messages")}
                line.update(prompt_ids=ids, response_ids=response,
                            response=tokenizer.decode(response, skip_special_tokens=False))
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            bar.update(len(chunk))
    return out_path


@torch.no_grad()
def _generate(model: PreTrainedModel, prompts: list[list[int]], pad_id: int, eos: set[int], max_new_tokens: int,
              temperature: float, seed: int) -> list[list[int]]:
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, length - len(p) :] = torch.tensor(p)
        attn[row, length - len(p) :] = 1
    sampling = {"do_sample": False}
    if temperature > 0:
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    out = model.generate(
        input_ids=ids.to(model.device), attention_mask=attn.to(model.device), max_new_tokens=max_new_tokens,
        pad_token_id=pad_id, eos_token_id=sorted(eos) or None, **sampling,
    )
    responses = []
    for row in out[:, length:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


def _written_ids(path: Path) -> set[str]:
    """Ids already regenerated; rewrites the file without a torn (unparseable) last line."""
    if not path.is_file():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    ids, good = set(), []
    for line in lines:
        try:
            ids.add(str(json.loads(line)["id"]))
            good.append(line if line.endswith("\n") else line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            break
    if len(good) != len(lines) or (lines and not lines[-1].endswith("\n")):
        path.write_text("".join(good), encoding="utf-8")
    return ids


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set([eos] if isinstance(eos, int) else (eos or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _pad_id(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                      getattr(model.generation_config, "pad_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0
