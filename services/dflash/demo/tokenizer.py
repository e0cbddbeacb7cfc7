"""Byte-level BPE tokenizer for the demo target, trained on the corpus train split.

Saved as a Hugging Face ``PreTrainedTokenizerFast`` directory, so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash.demo import corpus

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 4096


def train_tokenizer(
    texts: list[str], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (vocabulary includes specials).

    Training is deterministic for a given list of texts.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        mask_token=MASK_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(
    out_dir: str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_files: int | None = None,
    texts: list[str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train on the corpus train split (or ``texts``) and save to ``out_dir``; tokenizer.json lands last,
    so an interrupted save leaves none and :func:`ensure_tokenizer` trains again."""
    if texts is None:
        texts = corpus.load_texts("train", max_files=max_files)
    tokenizer = train_tokenizer(texts, vocab_size)
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.is_dir() else None) as tmp:
        tokenizer.save_pretrained(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(Path(tmp).iterdir(), key=lambda p: p.name == "tokenizer.json"):
            shutil.move(str(path), out_dir / path.name)
    return tokenizer


def ensure_tokenizer(out_dir: str | Path, **kwargs: int | list[str] | None) -> Path:
    """Build the tokenizer in ``out_dir`` unless a saved one is already there."""
    out_dir = Path(out_dir)
    if not (out_dir / "tokenizer.json").is_file():
        build_tokenizer(out_dir, **kwargs)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m dflash.demo.tokenizer --out runs/demo/tokenizer``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/demo/tokenizer")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-files", type=int, default=None, help="the first N training files (default all)")
    parser.add_argument("--force", action="store_true", help="retrain even if present")
    args = parser.parse_args(argv)
    if args.force:
        build_tokenizer(args.out, args.vocab_size, max_files=args.max_files)
    else:
        ensure_tokenizer(args.out, vocab_size=args.vocab_size, max_files=args.max_files)
    print(f"tokenizer in {args.out}")


if __name__ == "__main__":
    main()
