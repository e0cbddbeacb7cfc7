"""`dflash train`: train a DFlash drafter for any Hugging Face causal LM target."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..errors import DFlashError

if TYPE_CHECKING:
    from ..training.config import TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a DFlash drafter for a target model",
        description="Train a drafter: (optionally) regenerate responses with the target, then train on random "
        "anchor blocks against the frozen target's features. Writes the drafter (config.json + "
        "model.safetensors) to --out, one per epoch to --out/epoch-N, and a resumable checkpoint.",
    )
    p.add_argument("--target", required=True, help="target model directory or hub id (a Hugging Face causal LM)")
    p.add_argument("--data", required=True,
                   help="JSONL of prompt/response, prompt_ids/response_ids, messages or text records")
    p.add_argument("--out", required=True, help="output directory (drafter, epoch-N/, checkpoint/, train_log.jsonl)")
    g = p.add_argument_group("data")
    g.add_argument("--regenerate", action="store_true",
                   help="first regenerate every response with the target (recommended)")
    g.add_argument("--regen-max-new-tokens", type=int, default=256,
                   help="response length cap when regenerating (default 256)")
    g.add_argument("--regen-temperature", type=float, default=0.0, help="0 regenerates greedily (default 0)")
    g.add_argument("--regen-batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    g.add_argument("--max-length", type=int, default=2048, help="tokens per sequence, prompt included (default 2048)")
    g.add_argument("--offline-features", action="store_true", help="cache target features to --out/features first")
    g.add_argument("--eval-prompts", help="JSONL of held-out prompts; tau is measured on them after every epoch")
    g.add_argument("--eval-max-new-tokens", type=int, default=128, help="tokens per eval prompt (default 128)")
    d = p.add_argument_group("drafter")
    d.add_argument("--block-size", type=int, default=16, help="block size (default 16)")
    d.add_argument("--num-layers", type=int, default=1, help="drafter layers (default 1; the paper uses 5)")
    d.add_argument("--num-features", type=int,
                   help="target layers to condition on, spread as in the paper (default up to 5)")
    d.add_argument("--target-layer-ids", type=_int_list, help="explicit target decoder layers, e.g. 1,9,17,25,33")
    d.add_argument("--mask-token-id", type=int, help="token id of the mask slot (default: the tokenizer's mask token)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    o.add_argument("--steps", type=int, help="stop after this many optimizer steps (the schedule fits them)")
    o.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (default 6e-4)")
    o.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    o.add_argument("--max-anchors", type=int, default=512, help="blocks per sequence at most (default 512)")
    o.add_argument("--gamma", type=float, help="loss weight decay exp(-(k-1)/gamma) (default 7 for block 16)")
    o.add_argument("--distill-weight", type=float, default=0.0,
                   help="share of KL to the target's softmax in [0, 1] (default 0)")
    o.add_argument("--hard-anchors", type=float, default=0.0,
                   help="share in [0, 1] of anchor sampling weighted by the target's uncertainty about the anchor "
                        "token, where decoding rounds start (default 0: uniform, as the paper)")
    o.add_argument("--miss-anchors", type=float, default=0.0,
                   help="share in [0, 1] of anchor sampling on the positions where the drafter's own next round "
                        "would start, right after its misses; costs one no-grad drafter pass per micro-batch "
                        "(default 0: uniform, as the paper)")
    o.add_argument("--amp", default="auto", choices=("auto", "bf16", "off"),
                   help="bf16 autocast (auto: CUDA, or CPUs with AMX)")
    o.add_argument("--attention", default="dense", choices=("dense", "sparse"),
                   help="block mask: dense (default) or sparse = compiled flex attention, whose attention cost "
                        "grows linearly with --max-anchors (CUDA only)")
    o.add_argument("--save-every", type=int, default=200, help="checkpoint every N steps (default 200)")
    o.add_argument("--log-every", type=int, default=10, help="log line every N steps (default 10)")
    o.add_argument("--seed", type=int, default=0, help="seed for data order, anchors and init (default 0)")
    o.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    o.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's; use 1 on a shared machine)")
    o.add_argument("--resume", action="store_true", help="continue from --out/checkpoint (same flags)")
    o.add_argument("--init-drafter", metavar="DIR",
                   help="start from this drafter's weights (public DFlash format) instead of a fresh init, "
                        "with a new schedule: fine-tune a published drafter or extend a finished run; its "
                        "shape must match the flags")
    p.set_defaults(handler=run)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from ..training.config import TrainConfig

    return TrainConfig(
        target=args.target, data=args.data, out_dir=args.out, block_size=args.block_size,
        num_layers=args.num_layers, num_features=args.num_features, target_layer_ids=args.target_layer_ids,
        mask_token_id=args.mask_token_id, epochs=args.epochs, max_steps=args.steps, lr=args.lr,
        batch_size=args.batch_size, grad_accum=args.grad_accum, max_length=args.max_length,
        max_anchors=args.max_anchors, gamma=args.gamma, distill_weight=args.distill_weight,
        hard_anchors=args.hard_anchors, miss_anchors=args.miss_anchors,
        offline_features=args.offline_features, regenerate=args.regenerate,
        regen_max_new_tokens=args.regen_max_new_tokens, regen_temperature=args.regen_temperature,
        regen_batch_size=args.regen_batch_size, eval_prompts=args.eval_prompts,
        eval_max_new_tokens=args.eval_max_new_tokens, save_every=args.save_every, log_every=args.log_every,
        seed=args.seed, device=args.device, amp=args.amp, attention=args.attention, resume=args.resume,
        init_drafter=args.init_drafter,
    )


def run(args: argparse.Namespace) -> int:
    from ..training.pipeline import train

    config = config_from_args(args)
    if args.threads is not None:
        if args.threads < 1:
            raise DFlashError(f"--threads must be a positive integer, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    out = train(config)
    print(f"drafter saved to {out}; run it with: dflash generate --target {args.target} --drafter {out} \"...\"")
    return 0
