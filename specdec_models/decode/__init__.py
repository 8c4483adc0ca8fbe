"""Decoding: plain, draft-model speculative and prophet speculative (`generate`; tree drafting for
EAGLE-3 heads in `tree`), its stats, the cost model and the choice of gamma (`cost`), and the CLI
(`python -m specdec_models.decode`, in `__main__.py`)."""

from .cost import SpeedProfile, choose_gamma
from .speculative import generate
from .stats import DecodeStats
from .tree import TreeSpec

__all__ = ["DecodeStats", "SpeedProfile", "TreeSpec", "choose_gamma", "generate"]
