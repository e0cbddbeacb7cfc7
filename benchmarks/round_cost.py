"""Per-round cost of the disaggregated path (drafter over gRPC + Redis context log) against co-located.

Not a test. Runs the same greedy requests through (a) the engine with its drafter in process and
(b) the engine with a RemoteDrafter talking to a drafter replica over loopback gRPC, with the session's
context log in a redis-server started here. Prints milliseconds per round for drafting (the part the
transport changes) and verifying, and checks both paths write the same tokens.

    python benchmarks/round_cost.py                      # tiny random models (seconds)
    python benchmarks/round_cost.py --target DIR --drafter DIR --device cuda --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny models for the default run


def tiny_dirs(root: Path) -> tuple[Path, Path]:
    from dflash.drafter.checkpoint import save_drafter
    from tiny import char_tokenizer, tiny_drafter, tiny_target

    target = tiny_target("qwen3", max_positions=1024)
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    save_drafter(tiny_drafter(target, block_size=8), root / "drafter")
    return root / "target", root / "drafter"


def per_round(engine, prompts, params) -> tuple[list[int], list[float], list[float]]:
    tokens, draft_ms, verify_ms = [], [], []
    for prompt in prompts:
        for out in engine.generate(engine.encode(prompt), params):
            tokens += out.token_ids
            if out.stats.index > 0 and out.stats.draft_tokens > 0:
                draft_ms.append(out.stats.draft_ms)
                verify_ms.append(out.stats.verify_ms)
    return tokens, draft_ms, verify_ms


def main(argv=None) -> int:
    from dflash.loading import build_engine
    from dflash.params import SamplingParams
    from dflash.service.config import ServiceConfig
    from dflash.service.drafter_server import DrafterServer
    from dflash.service.parts import build_draft_sessions, build_verifier_engine
    from dflash.service.redis_process import RedisProcess
    from dflash.service.session_store import RedisSessionStore

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", nargs="*",
                        default=["def f(x):\n    return", "import os\nprint(", "a = [1, 2]\nb ="])
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = (args.target, args.drafter) if args.target else tiny_dirs(Path(tmp))
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        local = build_engine(target, drafter, device=args.device, dtype=args.dtype)
        per_round(local, args.prompts[:1], params)  # warm-up
        local_tokens, local_draft, local_verify = per_round(local, args.prompts, params)
        with RedisProcess(Path(tmp) / "redis") as redis:
            config = ServiceConfig.from_dict({"mode": "disaggregated", "redis": {"url": redis.url},
                                              "drafter_net": {"context_window": 0},
                                              "model": {"target": str(target), "drafter": str(drafter),
                                                        "device": args.device, "dtype": args.dtype}, "metrics": "none"})
            store = RedisSessionStore(redis.url)
            server = DrafterServer(build_draft_sessions(config), store, advertise_every_s=0.5).start()
            try:
                remote = build_verifier_engine(config, store, None)
                per_round(remote, args.prompts[:1], params)
                remote_tokens, remote_draft, remote_verify = per_round(remote, args.prompts, params)
            finally:
                server.stop()
    report = {
        "rounds": len(local_draft),
        "colocated_draft_ms_median": statistics.median(local_draft),
        "disaggregated_draft_ms_median": statistics.median(remote_draft),
        "transport_overhead_ms_median": statistics.median(remote_draft) - statistics.median(local_draft),
        "colocated_verify_ms_median": statistics.median(local_verify),
        "disaggregated_verify_ms_median": statistics.median(remote_verify),
        "same_tokens": local_tokens == remote_tokens,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in report.items()}, indent=2))
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
