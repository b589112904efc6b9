"""minigpt: train tiny GPT models and look inside their attention heads."""

__version__ = "0.1.0"
