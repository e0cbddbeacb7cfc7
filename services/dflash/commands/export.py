"""`dflash export`: a drafter in another format, exactly the same network (or refused, naming the field).

`--format transformers`: our drafter (public DFlash format) -> a transformers DFlash assistant, which
`AutoModel.from_pretrained` loads and `target.generate(..., assistant_model=A, speculation_type="dflash")`
runs. `--format dflash`: the reverse, so a drafter trained for transformers' DFlash runs in our engine
and service. What maps to what, and what is refused: dflash.drafter.transformers_format.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DFlashError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FORMATS = ("transformers", "dflash")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="convert a drafter to transformers' DFlash assistant format, or back",
        description="--format transformers: SOURCE is our drafter (public DFlash format), OUT a checkpoint for "
                    "transformers' generate(..., speculation_type='dflash'). --format dflash: SOURCE is a "
                    "transformers DFlash assistant (muse_glimmer_assistant), OUT our drafter. Anything that would "
                    "not run exactly the same is refused, naming the config field.",
    )
    p.add_argument("source", help="the drafter to convert (directory or hub id)")
    p.add_argument("out", type=Path, help="output directory")
    p.add_argument("--format", required=True, choices=FORMATS, help="the format to write")
    p.add_argument("--target", help="the target model (directory or hub id): checks the drafter fits it, and with "
                                    "--format dflash supplies num_target_layers and vocab_size where SOURCE lacks them")
    p.add_argument("--overwrite", action="store_true", help="write into OUT even if it is not empty")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..drafter.checkpoint import check_compatible, load_drafter
    from ..drafter.transformers_format import export_transformers, import_transformers

    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        raise DFlashError(f"OUT '{args.out}' is not empty; choose another directory or pass --overwrite")
    target = _target_config(args.target) if args.target else None
    if args.format == "transformers":
        if target is not None:
            check_compatible(load_drafter(args.source).config, target, target.vocab_size)
        out = export_transformers(args.source, args.out)
        print(f"wrote {out} (transformers DFlash assistant: AutoModel.from_pretrained, speculation_type='dflash')")
    else:
        extra = {} if target is None else {"num_target_layers": target.num_hidden_layers,
                                           "vocab_size": target.vocab_size}
        out = import_transformers(args.source, args.out, **extra)
        if target is not None:
            check_compatible(load_drafter(out).config, target, target.vocab_size)
        print(f"wrote {out} (DFlash drafter: dflash generate --drafter {out})")
    return 0


def _target_config(path_or_id: str) -> PretrainedConfig:
    """The target's text config, read without loading its weights."""
    from transformers import AutoConfig

    from ..drafter.checkpoint import resolve_dir

    config = AutoConfig.from_pretrained(resolve_dir(path_or_id, "target"))
    return config.get_text_config() if hasattr(config, "get_text_config") else config
