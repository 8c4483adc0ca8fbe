"""Decoding: plain, draft-model speculative and prophet speculative (`generate`), its stats, the
cost model and the choice of gamma (`cost`), and the CLI (`python -m specdec_models.decode`, in
`__main__.py`)."""

from .cost import SpeedProfile, choose_gamma
from .speculative import generate
from .stats import DecodeStats

__all__ = ["DecodeStats", "SpeedProfile", "choose_gamma", "generate"]
