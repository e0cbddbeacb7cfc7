"""From-scratch causal-LM pretraining on CPU, resumable from an atomic checkpoint.

:func:`train_lm` trains the demo target on the stdlib corpus, and is reused to
train small autoregressive draft models on JSONL data (``{"text": ...}`` lines).
CLI: ``python -m dflash.demo.pretrain --out runs/demo/target --steps N``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    get_cosine_with_min_lr_schedule_with_warmup,
)

from dflash.demo import corpus
from dflash.demo.tokenizer import ensure_tokenizer
from dflash.errors import CheckpointError, DFlashError

CHECKPOINT = "checkpoint.pt"
TRAIN_LOG = "train_log.jsonl"


def demo_model_config(
    vocab_size: int = 4096,
    hidden_size: int = 256,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    eos_token_id: int = 0,
) -> Qwen3Config:
    """Return the Qwen3 configuration of the demo target (about 6.8M parameters)."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        attention_dropout=0.0,
    )


@dataclasses.dataclass
class TrainConfig:
    """Hyperparameters of one :func:`train_lm` run (everything but the model)."""

    steps: int = 1000
    batch_size: int = 48
    seq_len: int = 256
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 500
    eval_windows: int = 64
    bf16: bool = True
    threads: int = 2


# ---------------------------------------------------------------- data


def read_jsonl_texts(path: str | Path) -> list[str]:
    """Return the ``text`` field of every line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def resolve_texts(data: str, max_files: int | None = None) -> list[str]:
    """Texts for ``data``: "corpus" (stdlib train split) or a JSONL path."""
    if data == "corpus":
        return corpus.load_texts("train", max_files=max_files)
    texts = read_jsonl_texts(data)
    return texts[:max_files] if max_files is not None else texts


def tokenize_concat(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> np.ndarray:
    """Tokenize ``texts`` and join them with EOS (also before the first text)."""
    eos = tokenizer.eos_token_id
    parts = [np.array([eos], dtype=np.int64)]
    batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for ids in batch:
        parts.append(np.asarray(ids, dtype=np.int64))
        parts.append(np.array([eos], dtype=np.int64))
    out = np.concatenate(parts)
    assert out.max() < 2**16
    return out.astype(np.uint16)


def cached_tokens(tokenizer: PreTrainedTokenizerBase, texts: list[str], path: Path) -> torch.Tensor:
    """Tokenize ``texts`` once, caching the token array in ``path`` (.npy).

    The cache is not keyed on the tokenizer or texts: delete it after changing either.
    """
    if path.is_file():
        arr = np.load(path)
    else:
        arr = tokenize_concat(tokenizer, texts)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, arr)
        os.replace(tmp, path)
    return torch.from_numpy(arr.astype(np.int64))


def sample_batch(tokens: torch.Tensor, batch: int, seq_len: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch`` random windows of ``seq_len + 1`` tokens; return inputs, targets."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    windows = tokens[idx]
    return windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping, evenly spread windows of ``seq_len + 1`` tokens for evaluation."""
    count = min(max_windows, (len(tokens) - 1) // seq_len)
    stride = (len(tokens) - seq_len - 1) // max(count - 1, 1)
    starts = torch.arange(count) * stride
    return tokens[starts[:, None] + torch.arange(seq_len + 1)[None, :]]


# ---------------------------------------------------------------- model / loss


def lm_loss(model: PreTrainedModel, inputs: torch.Tensor, targets: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 from (possibly bf16) logits."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: PreTrainedModel, windows: torch.Tensor, bf16: bool, batch: int = 16) -> float:
    """Mean next-token loss of ``model`` over evaluation ``windows``."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch):
        w = windows[i : i + batch]
        total += lm_loss(model, w[:, :-1], w[:, 1:], bf16).item() * len(w)
    model.train(was_training)
    return total / len(windows)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


# ---------------------------------------------------------------- checkpointing


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def truncate_log(log_path: Path, step: int) -> None:
    """Drop log lines past ``step`` (written after the checkpoint we resume from)."""
    if not log_path.is_file():
        return
    lines = log_path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    log_path.write_text("".join(line + "\n" for line in kept))


def append_log(log_path: Path, record: dict) -> None:
    """Append one JSON record to the training log."""
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- training


def _capture_rng(gen: torch.Generator) -> dict:
    return {
        "data": gen.get_state(),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _restore_rng(gen: torch.Generator, rng: dict) -> None:
    gen.set_state(rng["data"])
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])


def _load_data(tokenizer: PreTrainedTokenizerBase, data: str, out_dir: Path, max_files: int | None,
               texts: list[str] | None, heldout_texts: list[str] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if texts is None:
        texts = resolve_texts(data, max_files)
    train = cached_tokens(tokenizer, texts, out_dir / "train_tokens.npy")
    if heldout_texts is None:
        heldout_texts = corpus.load_texts("heldout")
    heldout = cached_tokens(tokenizer, heldout_texts, out_dir / "heldout_tokens.npy")
    return train, heldout


def _initial_weights(directory: str | Path, model_config: Qwen3Config) -> dict:
    if not (Path(directory) / "config.json").is_file():
        raise CheckpointError(f"--init-from '{directory}' is not a model directory (no config.json)")
    start = Qwen3ForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings"):
        theirs, ours = getattr(start.config, key), getattr(model_config, key)
        if theirs != ours:
            raise CheckpointError(f"--init-from '{directory}' has {key}={theirs!r} but the flags build {key}={ours!r}")
    return start.state_dict()


def _save_final(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    final = out_dir / "final"
    if final.exists():
        shutil.rmtree(final)
    model.to(torch.bfloat16).save_pretrained(final, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(final)


def train_lm(
    model_config: Qwen3Config,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    cfg: TrainConfig | None = None,
    *,
    data: str = "corpus",
    max_files: int | None = None,
    texts: list[str] | None = None,
    heldout_texts: list[str] | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    init_from: str | Path | None = None,
) -> dict:
    """Train a causal LM from scratch; resume from ``out_dir/checkpoint.pt`` if present.

    ``data`` is "corpus" or a JSONL path; ``texts``/``heldout_texts`` override the
    training/held-out texts (tests). ``stop_after`` ends the process-run early at
    that step (after checkpointing), simulating an interruption. ``init_from`` (a saved
    model directory of the same shape) replaces the random init of a fresh run, with a
    new schedule: it extends a finished run. Returns the metrics
    dict written to ``metrics.json`` (empty when stopped early).
    """
    cfg = cfg or TrainConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train_tokens, heldout_tokens = _load_data(
        tokenizer, data, out_dir, max_files, texts, heldout_texts
    )
    eval_set = eval_windows(heldout_tokens, cfg.seq_len, cfg.eval_windows)

    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(model_config)
    if init_from is not None:
        model.load_state_dict(_initial_weights(init_from, model_config))
    model.train()
    optimizer = make_optimizer(model, cfg)
    # Linear warmup to the peak lr, then cosine decay to min_lr_ratio of it.
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, cfg.warmup, cfg.steps,
                                                            min_lr_rate=cfg.min_lr_ratio)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, elapsed_before, tokens_seen = 0, 0.0, 0

    ckpt_path, log_path = out_dir / CHECKPOINT, out_dir / TRAIN_LOG
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _restore_rng(gen, state["rng"])
        step, elapsed_before = state["step"], state["elapsed"]
        tokens_seen = state["tokens_seen"]
        truncate_log(log_path, step)
    elif log_path.exists():
        log_path.unlink()

    tokens_per_step = cfg.batch_size * cfg.seq_len
    start = time.time()
    start_step = step
    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, dynamic_ncols=True)
    loss_value = float("nan")
    while step < cfg.steps:
        inputs, targets = sample_batch(train_tokens, cfg.batch_size, cfg.seq_len, gen)
        loss = lm_loss(model, inputs, targets, cfg.bf16)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        step += 1
        tokens_seen += tokens_per_step
        loss_value = loss.item()
        run_time = time.time() - start
        tps = (step - start_step) * tokens_per_step / max(run_time, 1e-9)
        record = {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "tokens_per_s": tps,
            "elapsed": elapsed_before + run_time,
        }
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record["heldout_loss"] = evaluate(model, eval_set, cfg.bf16)
        append_log(log_path, record)
        bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tps:.0f}")
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(
                ckpt_path,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": _capture_rng(gen),
                    "step": step,
                    "elapsed": elapsed_before + (time.time() - start),
                    "tokens_seen": tokens_seen,
                    "train_config": dataclasses.asdict(cfg),
                },
            )
        if stop_after is not None and step >= stop_after and step < cfg.steps:
            bar.close()
            return {}
    bar.close()

    heldout_loss = evaluate(model, eval_set, cfg.bf16)
    recent = _recent_train_loss(log_path)
    metrics = {
        "final_train_loss": recent if recent is not None else loss_value,
        "heldout_loss": heldout_loss,
        "heldout_perplexity": math.exp(heldout_loss),
        "steps": step,
        "tokens_seen": tokens_seen,
        "wall_time_s": elapsed_before + (time.time() - start),
        "seed": cfg.seed,
        "parameters": count_parameters(model),
        "train_tokens": len(train_tokens),
        "heldout_tokens": len(heldout_tokens),
        "data": data,
        "train_config": dataclasses.asdict(cfg),
        "model_config": model_config.to_dict(),
    }
    _save_final(model, tokenizer, out_dir)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return metrics


def _recent_train_loss(log_path: Path, last: int = 50) -> float | None:
    # A single step's loss is noisy; report the mean of the last few.
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    losses = [json.loads(line)["loss"] for line in lines[-last:]]
    return sum(losses) / len(losses) if losses else None


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse CLI flags; the model-shape defaults are the demo target's (`dflash demo build` passes every flag)."""
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="runs/demo/target")
    p.add_argument("--tokenizer", default="runs/demo/tokenizer")
    p.add_argument("--data", default="corpus", help='"corpus" or a JSONL of {"text": ...}')
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--no-bf16", dest="bf16", action="store_false")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--stop-after", type=int, default=None, help="simulate interruption")
    p.add_argument("--init-from", default=None,
                   help="start from this saved model's weights (same shape), with a new schedule")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--tie-embeddings", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: build the tokenizer if missing, then train; a bad flag or checkpoint exits 2."""
    try:
        _main(parse_args(argv))
    except DFlashError as exc:
        print(f"dflash.demo.pretrain: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _main(args: argparse.Namespace) -> None:
    ensure_tokenizer(args.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model_config = demo_model_config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_positions,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings,
        eos_token_id=tokenizer.eos_token_id,
    )
    field_names = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in field_names})
    metrics = train_lm(
        model_config,
        args.tokenizer,
        args.out,
        cfg,
        data=args.data,
        max_files=args.max_files,
        stop_after=args.stop_after,
        init_from=args.init_from,
    )
    if metrics:
        print(json.dumps({k: metrics[k] for k in ("heldout_loss", "heldout_perplexity")}))


if __name__ == "__main__":
    main()
