"""Where the built-in demo pair lives (package data, committed), used when no model is given."""

from __future__ import annotations

from pathlib import Path

from .errors import DFlashError

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFTER = DEMO_DIR / "drafter"
DEMO_AR_DRAFT = DEMO_DIR / "ar-draft"


def demo_pair() -> tuple[Path, Path]:
    """The demo target and drafter directories; a clear error when they have not been built."""
    for path in (DEMO_TARGET, DEMO_DRAFTER):
        if not (path / "config.json").is_file():
            raise DFlashError(
                f"the built-in demo model is missing ({path}); rebuild it with `dflash demo build` "
                "or pass --target/--drafter"
            )
    return DEMO_TARGET, DEMO_DRAFTER
