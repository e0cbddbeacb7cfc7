"""Subcommands of the `dflash` CLI; each module has `register(subparsers)`."""
