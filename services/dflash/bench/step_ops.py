"""How many aten operators one engine step runs, by number of sessions (torch's profiler).

On a GPU every operator is at least one kernel launch, so a step whose operator count grows with the
sessions it serves is launch-bound long before the device is busy. This counts, for one steady-state
step (every session decoding, no prefill), the aten operators the profiler records: plain decoding
(block 1) and whole-block DFlash verification (the drafter's block, verify policy "full").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from ..engine import SpeculativeEngine
from ..params import SamplingParams


@dataclass(frozen=True)
class StepOps:
    mode: str
    sessions: int
    operators: int
    top: tuple[tuple[str, int], ...]


def count_step_ops(engine: SpeculativeEngine, prompts: Sequence[list[int]], block_size: int | None,
                   warm_steps: int = 2) -> StepOps:
    """Operators of one step with len(prompts) decoding sessions (greedy), after the prefills and
    `warm_steps` more steps; the sessions are cancelled afterwards."""
    params = SamplingParams(max_new_tokens=256, block_size=block_size, ignore_eos=True)
    gens = [engine.start(list(p), params) for p in prompts]
    for g in gens:
        engine.submit(g)
    try:
        while any(g.prefilling or g.num_rounds == 0 for g in gens):
            engine.step()
        for _ in range(warm_steps):
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
    finally:
        for g in gens:
            engine.cancel(g)
        engine.step()
    names = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    mode = "plain" if block_size == 1 else f"dflash block {engine.drafter.block_size}"
    return StepOps(mode, len(prompts), sum(names.values()), tuple(names.most_common(8)))


def sweep(engine: SpeculativeEngine, prompts: Sequence[list[int]], sessions: Sequence[int]) -> list[StepOps]:
    modes: list[int | None] = [1] + ([None] if engine.drafter is not None else [])
    return [count_step_ops(engine, prompts[:n], mode) for mode in modes for n in sessions]


def format_ops(rows: Sequence[StepOps]) -> str:
    lines = [f"{'mode':<18} {'sessions':>8} {'aten ops':>9} {'x 1 session':>12}   most frequent"]
    base: dict[str, int] = {}
    for r in rows:
        base.setdefault(r.mode, r.operators)
        top = ", ".join(f"{name[6:]} {n}" for name, n in r.top[:4])
        lines.append(f"{r.mode:<18} {r.sessions:>8} {r.operators:>9} {r.operators / base[r.mode]:>11.2f}x   {top}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    from ..defaults import demo_pair
    from ..demo.corpus import heldout_prompts
    from ..loading import build_engine
    from ..scheduler import SchedulerConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", default="1,4,16", help="comma-separated session counts (default 1,4,16)")
    p.add_argument("--target", help="target directory (default: the demo target)")
    p.add_argument("--drafter", help="drafter directory (default: the demo drafter)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, drafter = (args.target, args.drafter) if args.target else demo_pair()
    engine = build_engine(target, drafter, scheduler=SchedulerConfig(verify_policy="full"))
    sessions = [int(s) for s in args.sessions.split(",")]
    prompts = [engine.encode(t) for t in heldout_prompts(max(sessions), seed=0)]
    print(format_ops(sweep(engine, prompts, sessions)))


if __name__ == "__main__":
    main()
