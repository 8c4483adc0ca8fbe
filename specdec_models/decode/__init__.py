"""Decoding: `generate` (plain, or speculative with one drafter from `drafters`: a draft model, a
prophet or EAGLE-3 head's chain, or an EAGLE-3 head's tree from `tree`, its looked-up path from a
datastore of the target's own answers in `datastore`), or prompt lookup alone (`lookup`), its stats, the cost model and the choice of
gamma (`cost`), and the CLI (`python -m specdec_models.decode`, in `__main__.py`)."""

from ..sampling import GREEDY, SamplingConfig
from .cost import SpeedProfile, choose_gamma
from .datastore import Datastore
from .drafters import Drafter, DraftModel, HeadDrafter, Lookup, TreeDrafter
from .speculative import generate
from .stats import DecodeStats
from .tree import TreeSpec

__all__ = ["GREEDY", "Datastore", "DecodeStats", "DraftModel", "Drafter", "HeadDrafter", "Lookup", "SamplingConfig",
           "SpeedProfile", "TreeDrafter", "TreeSpec", "choose_gamma", "generate"]
