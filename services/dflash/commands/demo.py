"""`dflash demo build`: build the demo pair from the Python standard library (see dflash.demo.build)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..demo.build import STAGES  # no torch: the CLI starts fast


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the built-in demo pair", description="Build the built-in demo pair.")
    demo_sub = p.add_subparsers(dest="demo_command", required=True, metavar="ACTION")
    b = demo_sub.add_parser(
        "build",
        help="train tokenizer, target, drafter and AR draft from the standard library, evaluate, install",
        description="One recipe: " + " -> ".join(STAGES) + ". Every stage resumes from its checkpoint and "
        "is skipped once its output exists; rerun the same command after an interruption.",
    )
    b.add_argument("--work", default="runs/demo", help="working directory for data, checkpoints and logs "
                   "(default runs/demo)")
    b.add_argument("--quick", action="store_true",
                   help="tiny models and data: every stage end to end in about 2 minutes on 2 CPU cores")
    b.add_argument("--budget", type=float, default=1.0,
                   help="scale the prompts of each kind and the training steps (and warmup steps) of the "
                   "target, drafter and AR draft by this factor (default 1: the shipped pair's settings)")
    b.add_argument("--stages", default="all", help="comma-separated stages to run, of " + ",".join(STAGES)
                   + " (default all)")
    b.add_argument("--install-to", default=None,
                   help="where install puts the pair (default WORK/installed); the package's own demo pair "
                   "(services/dflash/assets/demo) is replaced only when named here")
    b.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (default: all cores)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..defaults import DEMO_DIR
    from ..demo.build import Build, build
    from ..demo.recipe import QUICK, Recipe
    from ..errors import DFlashError

    stages = STAGES if args.stages == "all" else tuple(s.strip() for s in args.stages.split(","))
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise DFlashError(f"unknown stage(s) {unknown}; choose from {','.join(STAGES)}")
    if not (math.isfinite(args.budget) and args.budget > 0):
        raise DFlashError(f"--budget must be a positive number, got {args.budget}")
    if args.threads < 1:
        raise DFlashError(f"--threads must be at least 1, got {args.threads}")
    work = Path(args.work)
    install_to = Path(args.install_to) if args.install_to else work / "installed"
    if args.quick and "install" in stages and install_to.resolve() == DEMO_DIR.resolve():
        raise DFlashError("a --quick build does not replace the package's demo pair; choose another --install-to")
    recipe = (QUICK if args.quick else Recipe()).scaled(args.budget)
    command = "dflash demo build --work runs/demo" + (" --quick" if args.quick else "") \
        + (f" --budget {args.budget:g}" if args.budget != 1 else "")
    build(Build(work, recipe, args.threads, install_to, command), tuple(s for s in STAGES if s in stages))
    return 0
