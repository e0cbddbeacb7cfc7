"""`dflash generate`: stream one generation to the terminal, with statistics."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..defaults import demo_pair
from ..errors import DFlashError
from ..params import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate from a prompt; with no --target, the built-in demo pair is used.",
    )
    p.add_argument("prompt", help="prompt text")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object (token ids, text, statistics)")
    p.set_defaults(handler=run)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory or hub id (default: built-in demo target)")
    p.add_argument("--drafter", help="DFlash drafter directory or hub id (default: demo drafter with the demo target)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16 or float16 (auto: checkpoint dtype on GPU, float32 on CPU)")
    p.add_argument("--drafter-dtype", default="auto",
                   help="the drafter's dtype (auto: bfloat16 beside a float32 target on a CPU with AMX, else the "
                        "target's); it changes how many proposals are accepted, never the output")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 keeps all (default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling; same seed, same text at any block size")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the text")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")
    p.add_argument("--block-size", type=int, default=None,
                   help="draft block size; 1 runs the target alone (default: the drafter's)")
    p.add_argument("--draft-confidence", type=float, default=0.0,
                   help="verify only the leading drafts whose joint drafter confidence stays >= this (0, the "
                        "default, verifies the whole block; same output, fewer verified tokens on a CPU)")
    p.add_argument("--verify-policy", choices=("adaptive", "full"), default="adaptive",
                   help="adaptive (default): draft and verify only what pays on this device at this batch, "
                        "measured (on a CPU a lone stream often decodes mostly target-only); full: every "
                        "round drafts and verifies the whole block, as the paper does")


def params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
        block_size=args.block_size,
        draft_confidence=args.draft_confidence,
    )


def model_dirs(args: argparse.Namespace) -> tuple[str | Path, str | Path | None]:
    if args.target is None:
        target, drafter = demo_pair()
        return target, args.drafter or drafter
    return args.target, args.drafter


def run(args: argparse.Namespace) -> int:
    from ..loading import build_engine

    params = params_from_args(args)
    target, drafter = model_dirs(args)
    if params.block_size == 1:
        drafter = None
    from ..scheduler import SchedulerConfig

    engine = build_engine(target, drafter, device=args.device, dtype=args.dtype, drafter_dtype=args.drafter_dtype,
                          scheduler=SchedulerConfig(verify_policy=args.verify_policy))
    prompt = args.prompt
    if args.chat:
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise DFlashError("--chat: this target's tokenizer has no chat template")
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    prompt_ids = engine.encode(prompt)
    tokens, pieces, finish, totals = [], [], None, None
    for r in engine.generate(prompt_ids, params):
        tokens += r.token_ids
        pieces.append(r.text)
        finish, totals = r.finish_reason, r.totals
        if not args.json:
            sys.stdout.write(r.text)
            sys.stdout.flush()
    stats = totals.to_dict()
    if args.json:
        json.dump({"prompt": args.prompt, "token_ids": tokens, "text": "".join(pieces),
                   "finish_reason": finish, "block_size": params.block_size, "stats": stats}, sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n")
        print(format_stats(stats, finish), file=sys.stderr)
    return 0


def format_stats(stats: dict, finish: str | None) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in stats["acceptance_histogram"].items())
    return (
        f"[{stats['generated_tokens']} tokens, finish={finish}] tau={stats['tau']:.2f} over {stats['rounds']} rounds "
        f"| decode {stats['decode_tokens_per_s']:.1f} tok/s | TTFT {stats['ttft_s'] * 1000:.1f} ms "
        f"| draft {stats['draft_s'] * 1000:.0f} ms, verify {stats['verify_s'] * 1000:.0f} ms"
        + (f" | committed/round {hist}" if hist else "")
    )
