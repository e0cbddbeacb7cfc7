"""The DFlash drafter: its config, model, checkpoint format, and the interface the engine calls."""

from .config import DFlashConfig, default_target_layer_ids
from .model import DFlashDraftModel, DraftCache
from .protocol import Drafter

__all__ = ["DFlashConfig", "DFlashDraftModel", "DraftCache", "Drafter", "default_target_layer_ids"]
