"""Training DFlash drafters for any Hugging Face causal LM: data, regeneration, blocks, features, loop."""

from .config import TrainConfig, TrainConfigError

__all__ = ["TrainConfig", "TrainConfigError"]
