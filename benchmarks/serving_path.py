"""The serving path in process: static batch vs the engine's own steps vs streams read by threads.

Not a test. Prints one table from one run (see dflash.bench.inprocess for what each way is); with
--passes N the streams runs are made N times, alternating, and the cells are medians:

    python benchmarks/serving_path.py                           # demo pair, 1, 8 and 16 streams
    python benchmarks/serving_path.py --streams 16 --max-new-tokens 64 --policies full
    python benchmarks/serving_path.py --passes 3                # what issue 31's ratios are read from
    python benchmarks/serving_path.py --streams 1 --requests-per-stream 8 --passes 3   # a lone stream, 8 texts
    python benchmarks/serving_path.py --dtype bfloat16          # the bf16 regime (AMX matmuls on a recent Xeon)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,8,16", help="comma-separated concurrencies (default 1,8,16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto", help="the engines' dtype (default auto: float32 on CPU)")
    p.add_argument("--drafter-dtype", default="auto",
                   help="the drafter's dtype (default auto: bfloat16 beside a float32 target on an AMX CPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: what a replica gets)")
    p.add_argument("--policies", default="adaptive,full", help="verify policies to run DFlash with (default both)")
    p.add_argument("--stream-interval-ms", type=float, help="the engine's stream interval (default: its default)")
    p.add_argument("--passes", type=int, default=1,
                   help="the streams runs this many times, methods' order reversed every other pass (default 1)")
    p.add_argument("--requests-per-stream", type=int, default=1,
                   help="requests each stream of the streams runs makes one after another, each on its own "
                        "prompt (default 1); a lone stream's figure then spans several texts")
    p.add_argument("--json", type=Path, help="also write the cells here")
    args = p.parse_args()

    import torch
    from dflash.bench.inprocess import format_cells, format_policy, sweep
    from dflash.defaults import demo_pair
    from dflash.demo.corpus import heldout_prompts
    from dflash.loading import build_engine
    from dflash.scheduler import SchedulerConfig

    torch.set_num_threads(args.threads)
    concurrencies = [int(c) for c in args.streams.split(",")]
    extra = {} if args.stream_interval_ms is None else {"stream_interval_ms": args.stream_interval_ms}
    engines = {name: build_engine(*demo_pair(), dtype=args.dtype, drafter_dtype=args.drafter_dtype,
                                  scheduler=SchedulerConfig(verify_policy=name, **extra))
               for name in args.policies.split(",")}
    encode = next(iter(engines.values())).encode
    # At least 16 drawn, so a concurrency runs on the same prompts (the last c) whatever else is swept.
    wanted = max(max(concurrencies) * args.requests_per_stream, 16)
    prompts = [encode(t) for t in heldout_prompts(wanted, seed=0)]
    cells = sweep(engines, prompts, concurrencies, args.max_new_tokens, args.passes, args.requests_per_stream)
    print(format_cells(cells))
    if any(c.method == "dflash adaptive" for c in cells) and len(engines) + 1 > 2:
        print()
        print(format_policy(cells))
    if args.json:
        args.json.write_text(json.dumps([c.to_dict() for c in cells], indent=1))


if __name__ == "__main__":
    main()
