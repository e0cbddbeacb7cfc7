"""`dflash regenerate`: write the target's own responses to a prompts file, once, for several training runs.

`dflash train --regenerate` does the same inside one run; this command makes the data a file of its own,
so that a longer or differently configured run (or the autoregressive baseline) reuses it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import DFlashError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "regenerate",
        help="regenerate a dataset's responses with the target itself (drafter training data)",
        description="Write one JSONL line per prompt with the target's response (prompt_ids, response_ids, "
        "response). Resumable: ids already in --out are skipped, so rerun the same command after an "
        "interruption, or append new prompts to --data and rerun to extend the file.",
    )
    p.add_argument("--target", required=True, help="target model directory or hub id (a Hugging Face causal LM)")
    p.add_argument("--data", required=True, help="JSONL of prompt, messages or text records, each with an id")
    p.add_argument("--out", required=True, help="output JSONL (appended to; ids already there are skipped)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap (default 256)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="keep only the last N prompt tokens (default: all); match --max-length minus --block-size "
                        "of the training run")
    p.add_argument("--temperature", type=float, default=0.0, help="0 regenerates greedily (default 0)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed when --temperature > 0 (default 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.temperature < 0:
        raise DFlashError(f"--temperature must be >= 0, got {args.temperature}")
    if not Path(args.data).is_file():
        raise DFlashError(f"data file '{args.data}' does not exist")
    import torch

    from ..loading import load_target, resolve_device, resolve_dtype
    from ..training.regenerate import regenerate

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, tokenizer = load_target(args.target, device, resolve_dtype("auto", device))
    if tokenizer is None:
        raise DFlashError(f"target '{args.target}' has no tokenizer files; regeneration needs its tokenizer")
    out = regenerate(model, tokenizer, args.data, args.out, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, batch_size=args.batch_size, seed=args.seed,
                     max_prompt_tokens=args.max_prompt_tokens)
    print(f"responses written to {out}; train on them with: dflash train --target {args.target} --data {out} ...")
    return 0
