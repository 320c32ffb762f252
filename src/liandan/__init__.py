"""liandan: pretrain a language model from raw text, and survive doing it."""

__version__ = "0.1.0"
