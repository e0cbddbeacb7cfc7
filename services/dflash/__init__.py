"""dflash: lossless block-diffusion speculative decoding (DFlash) on any Hugging Face causal LM."""

__version__ = "0.1.0"
