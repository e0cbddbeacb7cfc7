"""Fast checks of the demo corpus, tokenizer and resumable pretraining loop (the build: test_demo_build.py)."""

from __future__ import annotations

import json
import math

import pytest
from dflash.demo import corpus
from dflash.demo.pretrain import TrainConfig, demo_model_config, train_lm
from dflash.demo.tokenizer import MASK_TOKEN, build_tokenizer
from dflash.errors import CheckpointError
from transformers import AutoTokenizer

SAMPLE = 'def área(r):\n    """Circle area."""\n    return 3.14159 * r ** 2  # ok\n'


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus.load_texts("train", max_files=8)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, texts):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, vocab_size=512, texts=texts)
    return out


def _tiny_config(vocab: int):
    return demo_model_config(
        vocab_size=vocab,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=128,
    )


def _train(tok_dir, out, texts, steps, stop_after=None, init_from=None, **cfg):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    defaults = dict(steps=steps, batch_size=4, seq_len=32, lr=3e-3, warmup=2,
                    checkpoint_every=3, eval_every=1000, eval_windows=4)
    defaults.update(cfg)
    return train_lm(
        _tiny_config(len(tok)), tok_dir, out, TrainConfig(**defaults),
        texts=texts, heldout_texts=texts[:1], stop_after=stop_after, progress=False, init_from=init_from,
    )


def _losses(out) -> list[float]:
    lines = (out / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_corpus_splits_are_disjoint():
    held = set(corpus.list_files("heldout"))
    assert len(held) == len(corpus.HELD_OUT_MODULES)
    assert held.isdisjoint(corpus.list_files("train")[:50])
    assert corpus.heldout_prompts(4, 200, seed=1) == corpus.heldout_prompts(4, 200, seed=1)


def test_unseen_split_is_stdlib_code_the_target_never_trained_on():
    """Drafter-only data: the stdlib's test/tool folders; never a training file, a held-out module,
    third-party code or a build folder."""
    root = corpus.stdlib_root()
    unseen = corpus.list_files("unseen")
    assert unseen, "this Python ships no test suite or tools"
    rels = [p.relative_to(root) for p in unseen]
    assert set(unseen).isdisjoint(corpus.list_files("train"))
    assert set(unseen).isdisjoint(corpus.list_files("heldout"))
    for rel in rels:
        assert not {"site-packages", "dist-packages"} & set(rel.parts)
        assert not any(part.startswith("config-") for part in rel.parts)
        assert {"test", "tests", "idlelib", "lib2to3", "idle_test", "turtledemo"} & set(rel.parts[:-1])
    prompts = corpus.unseen_prompts(5, 200, seed=1)
    assert len(set(prompts)) == 5 and prompts == corpus.unseen_prompts(5, 200, seed=1)


def test_line_prompts_start_at_new_mid_file_lines():
    """The mid-file prompts: distinct, full length, each at a non-blank line start that no definition-start
    prompt (cut_prompts) can begin at; deterministic per seed."""
    texts = ["import os\n\ndef f(x):\n    y = x + 1\n    return y\n\n\nclass C:\n    z = f(2)\n" * 3,
             "    async def g():\n        await h()\n# comment line\nvalue = [1, 2, 3]\n" * 3]
    prompts = corpus.line_prompts(texts, 6, 30, seed=3)
    assert len(prompts) == len(set(prompts)) == 6 and prompts == corpus.line_prompts(texts, 6, 30, seed=3)
    definitions = set(corpus.cut_prompts(texts, 100, 30, seed=0))
    for p in prompts:
        assert len(p) == 30 and p.split("\n")[0].strip() and p not in definitions
        assert not p.lstrip().startswith(("def ", "class ", "async def "))
        assert any(t.startswith(p) or ("\n" + p) in t for t in texts)


def test_tokenizer_round_trip_and_mask(tok_dir):
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    assert tok.decode(ids) == SAMPLE
    assert tok.mask_token == MASK_TOKEN and tok.mask_token_id is not None
    assert tok.eos_token_id == tok.pad_token_id != tok.mask_token_id
    assert len(tok) == 512


def test_training_lowers_loss(tok_dir, texts, tmp_path):
    metrics = _train(tok_dir, tmp_path, texts, steps=30, lr=1e-2)
    losses = _losses(tmp_path)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert metrics["steps"] == 30 and metrics["heldout_perplexity"] > 1


def test_schedule_is_linear_warmup_then_cosine_to_the_min_ratio(tok_dir, texts, tmp_path):
    """transformers' cosine schedule with a minimum: from the end of warmup on, each step's learning rate is
    what the hand-written schedule it replaced gave (peak, cosine decay to min_lr_ratio of it); warmup rises
    linearly from 0 (the hand-written one started one warmup step further up)."""
    steps, warmup, peak, ratio = 10, 2, 3e-3, 0.1
    _train(tok_dir, tmp_path, texts, steps=steps, warmup=warmup, lr=peak, min_lr_ratio=ratio)
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    for step in range(warmup, steps):  # log line `step` holds the learning rate of scheduler step `step`
        progress = (step - warmup) / (steps - warmup)
        hand_written = ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lrs[step] == pytest.approx(peak * hand_written, rel=1e-12), step
    assert lrs[:warmup + 1] == pytest.approx([0.0, peak / 2, peak])
    assert lrs[6] == pytest.approx(peak * (ratio + (1 - ratio) / 2))  # halfway through the decay


def test_resume_matches_uninterrupted_run(tok_dir, texts, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    _train(tok_dir, full, texts, steps=8)
    # Interrupted at step 5: the checkpoint is from step 3, steps 4-5 are redone.
    assert _train(tok_dir, split, texts, steps=8, stop_after=5) == {}
    _train(tok_dir, split, texts, steps=8)
    assert _losses(split) == _losses(full)


def test_init_from_extends_a_finished_run(tok_dir, texts, tmp_path):
    first, second, fresh = tmp_path / "first", tmp_path / "second", tmp_path / "fresh"
    _train(tok_dir, first, texts, steps=30, lr=1e-2)
    _train(tok_dir, second, texts, steps=2, init_from=first / "final")
    _train(tok_dir, fresh, texts, steps=2)
    # The extension starts where the first run ended, far below a random init.
    assert _losses(second)[0] < _losses(fresh)[0] - 0.3
    assert abs(_losses(second)[0] - sum(_losses(first)[-5:]) / 5) < 0.5
    # Weights of another shape are refused with the field that differs, before any step.
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    wider = demo_model_config(vocab_size=len(tok), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                              head_dim=16, intermediate_size=64, max_position_embeddings=128)
    with pytest.raises(CheckpointError, match="no config.json"):
        _train(tok_dir, tmp_path / "bad", texts, steps=2, init_from=tmp_path / "missing")
    with pytest.raises(CheckpointError, match="num_hidden_layers=1 but the flags build num_hidden_layers=2"):
        train_lm(wider, tok_dir, tmp_path / "bad", TrainConfig(steps=2, batch_size=4, seq_len=32),
                 texts=texts, heldout_texts=texts[:1], progress=False, init_from=first / "final")
