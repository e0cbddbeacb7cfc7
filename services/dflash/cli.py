"""The `dflash` command: one subcommand per module in dflash.commands."""

from __future__ import annotations

import argparse
import sys

from .commands import bench, client, demo, export, generate, regenerate, serve, tls_front, train
from .errors import DFlashError

COMMANDS = (generate, train, regenerate, demo, bench, serve, client, tls_front, export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except DFlashError as exc:
        print(f"dflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
