"""Linear weights row-major (as loaded) against column-major (`dflash.loading.lay_out_for_device`), on CPU.

Not a test. The demo pair, one torch thread: a target decode step (1 token), a 16-token verify forward
(both on a 200-token cache) and one drafter call (16-token block, 3 new context rows on 200 cached),
each timed with both layouts alternating call by call, so both sides of each ratio share the machine's
load; prints the medians and the median of the per-call ratios, and whether both layouts picked the
same tokens:

    python benchmarks/weight_layout.py            # 300 calls of each
    python benchmarks/weight_layout.py --calls 1000
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch
    from dflash.defaults import demo_pair
    from dflash.drafter.checkpoint import load_drafter
    from dflash.drafter.local import LocalDrafter
    from dflash.drafter.protocol import DraftRequest
    from dflash.loading import lay_out_for_device
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(args.threads)
    target_dir, drafter_dir = demo_pair()
    rows = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    cols = lay_out_for_device(copy.deepcopy(rows))
    draft_rows = load_drafter(drafter_dir, dtype=torch.float32)
    draft_cols = lay_out_for_device(copy.deepcopy(draft_rows))
    drafters = {"row-major": LocalDrafter(draft_rows, rows.get_input_embeddings(), rows.get_output_embeddings()),
                "column-major": LocalDrafter(draft_cols, cols.get_input_embeddings(), cols.get_output_embeddings())}
    models = {"row-major": rows, "column-major": cols}
    cfg = draft_rows.config
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, cfg.vocab_size, (1, 200), generator=gen)
    context = torch.randn(200, cfg.num_features * cfg.hidden_size, generator=gen)
    new_rows = torch.randn(3, cfg.num_features * cfg.hidden_size, generator=gen)

    with torch.inference_mode():
        caches = {}
        for name, model in models.items():
            caches[name] = DynamicCache()
            model(prompt, cache=caches[name])
            drafters[name].draft_batch([DraftRequest("s", context, 0, 5, cfg.block_size)])

        def target_call(name: str, n: int) -> object:
            ids = torch.randint(5, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            out = models[name](ids, cache=caches[name], position_ids=torch.arange(200, 200 + n)[None])
            caches[name].crop(-n)
            return out.logits.argmax(-1).tolist()

        def draft_call(name: str) -> object:
            out = drafters[name].draft_batch([DraftRequest("s", new_rows, 200, 5, cfg.block_size)])
            drafters[name].cache.crop("s", 200)
            return out[0].tokens.tolist()

        parts = {"target decode step (1 token)": lambda name: target_call(name, 1),
                 f"target verify ({cfg.block_size} tokens)": lambda name: target_call(name, cfg.block_size),
                 f"drafter call (block {cfg.block_size})": draft_call}
        print("| part | row-major ms | column-major ms | column / row (median of per-call ratios) | same tokens |")
        print("|---|---|---|---|---|")
        for label, call in parts.items():
            times = {name: [] for name in models}
            picks = {}
            for _ in range(args.calls + 20):
                for name in models:
                    t0 = time.perf_counter()
                    picks[name] = call(name)
                    times[name].append(time.perf_counter() - t0)
            row, col = times["row-major"][20:], times["column-major"][20:]
            ratio = statistics.median(c / r for c, r in zip(col, row))
            print(f"| {label} | {statistics.median(row) * 1e3:.3f} | {statistics.median(col) * 1e3:.3f} | "
                  f"{ratio:.3f} | {picks['row-major'] == picks['column-major']} |")


if __name__ == "__main__":
    main()
