"""megagate: gated-attention transformers trained on megatron-core."""

__version__ = "0.1.0"
