"""Where a DFlash drafter loses rounds: its first draft token at the anchors greedy decoding really visits.

On greedy target completions of held-out prompts, the drafter's block is predicted (teacher-forced, one
forward) at every position; greedy rounds are then replayed from those blocks (a round's next anchor is the
target's token where the draft first failed), which gives the engine's tau without running it. Slot-1
accuracy (the first draft token after the anchor) is compared at all positions and at the replayed rounds'
anchors, split by the target's own probability of the anchor token, and beside an autoregressive draft's
next-token accuracy at the same positions.

    python benchmarks/anchor_difficulty.py                      # the demo pair and its AR draft
    python benchmarks/anchor_difficulty.py --target T --drafter D --ar-draft A --prompts p.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
from dflash.defaults import DEMO_AR_DRAFT, DEMO_DRAFTER, DEMO_TARGET
from dflash.demo import corpus
from dflash.demo.build import NUM_EVAL_PROMPTS, SEED
from dflash.drafter.checkpoint import load_drafter
from dflash.loading import load_target
from dflash.training.blocks import make_blocks
from dflash.training.data import prompt_ids, read_records
from dflash.training.features import select_features
from transformers import AutoModelForCausalLM

BINS = ((0.0, 0.5), (0.5, 0.9), (0.9, 1.01))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(DEMO_TARGET))
    p.add_argument("--drafter", default=str(DEMO_DRAFTER))
    p.add_argument("--ar-draft", default=str(DEMO_AR_DRAFT))
    p.add_argument("--prompts", help="JSONL of prompts (default: the demo's held-out stdlib prompts)")
    p.add_argument("--num-prompts", type=int, default=NUM_EVAL_PROMPTS,
                   help=f"the first N prompts (default {NUM_EVAL_PROMPTS}, as the demo eval)")
    p.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt (default 96, as the "
                   "trainer's held-out tau)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    model, tok = load_target(args.target, device, torch.float32)
    drafter = load_drafter(args.drafter, dtype=torch.float32).eval()
    ar = AutoModelForCausalLM.from_pretrained(args.ar_draft, dtype=torch.float32).eval()
    if args.prompts:
        prompts = [prompt_ids(r, tok) for r in read_records(args.prompts)]
    else:
        prompts = [tok.encode(t) for t in corpus.heldout_prompts(args.num_prompts, seed=SEED)]
    prompts = prompts[:args.num_prompts]
    block, layer_ids = drafter.config.block_size, drafter.config.target_layer_ids

    everywhere: list[tuple[float, bool, bool]] = []  # (target p(anchor), drafter slot 1 hit, AR hit)
    visited: list[tuple[float, bool, bool]] = []
    rounds = committed = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, do_sample=False,
                                 min_new_tokens=args.tokens)
            start, end = len(prompt), ids.shape[1]
            out = model(input_ids=ids, output_hidden_states=True)
            probs = out.logits[0].softmax(-1)
            features = select_features(out.hidden_states, layer_ids)
            anchors = torch.arange(start, end - 1)[None]
            loss_mask = torch.zeros_like(ids)
            loss_mask[:, start:] = 1
            blocks = make_blocks(ids, loss_mask, anchors, torch.ones_like(anchors, dtype=torch.bool), block,
                                 drafter.config.mask_token_id)
            positions = torch.cat([torch.arange(ids.shape[1])[None], blocks.positions], dim=1)
            noise = model.get_input_embeddings()(blocks.token_ids)
            hidden = drafter(noise, features, positions, attention_mask=blocks.attention_mask)
            pred = model.get_output_embeddings()(hidden).argmax(-1).view(-1, block)
            ar_pred = ar(input_ids=ids).logits[0].argmax(-1)
            row = []
            for j, a in enumerate(range(start, end - 1)):
                row.append((probs[a - 1, ids[0, a]].item(), pred[j, 1].item() == ids[0, a + 1].item(),
                            ar_pred[a].item() == ids[0, a + 1].item()))
            everywhere += row
            a = start  # the first round's anchor: prefill's token
            while a < end - 1:
                visited.append(row[a - start])
                k = 1
                while k < block and a + k < end and pred[a - start, k].item() == ids[0, a + k].item():
                    k += 1
                rounds += 1
                committed += min(k, end - a)
                a += k

    def summary(rows: list[tuple[float, bool, bool]]) -> dict:
        conf = torch.tensor([r[0] for r in rows])
        hit = torch.tensor([r[1] for r in rows], dtype=torch.float)
        ar_hit = torch.tensor([r[2] for r in rows], dtype=torch.float)
        out = {"anchors": len(rows), "mean_target_p_anchor": round(conf.mean().item(), 3),
               "drafter_slot1_acc": round(hit.mean().item(), 3), "ar_next_token_acc": round(ar_hit.mean().item(), 3),
               "by_target_p_anchor": {}}
        for lo, hi in BINS:
            m = (conf >= lo) & (conf < hi)
            out["by_target_p_anchor"][f"[{lo}, {min(hi, 1.0)}]"] = {
                "share": round(m.float().mean().item(), 3),
                "drafter_slot1_acc": round(hit[m].mean().item(), 3) if m.any() else None}
        return out

    print(json.dumps({"replayed_tau": round(committed / rounds, 3), "rounds": rounds,
                      "all_positions": summary(everywhere), "round_anchors": summary(visited)}, indent=1))


if __name__ == "__main__":
    main()
