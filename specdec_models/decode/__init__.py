"""Decoding: plain, draft-model speculative and prophet speculative (`generate`), and the CLI
(`python -m specdec_models.decode`, in `__main__.py`)."""

from .speculative import DecodeStats, generate

__all__ = ["DecodeStats", "generate"]
