"""Decoding: plain, draft-model speculative and prophet speculative (`generate`; tree drafting for
EAGLE-3 heads in `tree`, with a datastore of the target's own answers in `datastore`), its stats,
the cost model and the choice of gamma (`cost`), and the CLI (`python -m specdec_models.decode`, in
`__main__.py`)."""

from .cost import SpeedProfile, choose_gamma
from .datastore import Datastore
from .speculative import generate
from .stats import DecodeStats
from .tree import TreeSpec

__all__ = ["Datastore", "DecodeStats", "SpeedProfile", "TreeSpec", "choose_gamma", "generate"]
