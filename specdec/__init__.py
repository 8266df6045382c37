"""specdec: lossless speculative decoding served as separate draft, target and coordinator services."""

__version__ = "0.1.0"
