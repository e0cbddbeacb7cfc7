"""`dflash demo build`: rebuild the built-in demo pair (see dflash.demo.build)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("demo", help="the built-in demo pair", description="Rebuild the built-in demo pair.")
    demo_sub = p.add_subparsers(dest="demo_command", required=True, metavar="ACTION")
    b = demo_sub.add_parser(
        "build",
        help="train tokenizer, target, drafter and baseline from the standard library, evaluate, install",
        description="Every stage resumes from its checkpoint; rerun the same command after an interruption.",
    )
    b.add_argument("--work", default="runs/demo", help="working directory for checkpoints and logs (default runs/demo)")
    b.add_argument("--stages", default="all",
                   help="comma-separated subset of the stages, in order: " + ",".join(_stages()) + " (default all);"
                   " 'restore' (not in all) seeds a lost work directory from the installed pair, so that later"
                   " stages continue from it")
    p.set_defaults(handler=run)


def _stages() -> list[str]:
    from ..demo.build import STAGES

    return STAGES


def run(args: argparse.Namespace) -> int:
    from ..demo.build import EXTRA_STAGES, STAGES, build
    from ..errors import DFlashError

    stages = STAGES if args.stages == "all" else [s.strip() for s in args.stages.split(",")]
    unknown = [s for s in stages if s not in STAGES and s not in EXTRA_STAGES]
    if unknown:
        raise DFlashError(f"unknown stage(s) {unknown}; choose from {','.join(STAGES + list(EXTRA_STAGES))}")
    build(Path(args.work), stages)
    return 0
