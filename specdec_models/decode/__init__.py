"""Decoding: `generate` (plain, or speculative with one drafter from `drafters`, in one loop
whatever the drafter: the protocol is `protocol`; chain drafters in `chain` (a draft model, a
prophet or EAGLE-3 head), an EAGLE-3 head's tree in `tree`, a head that drafts a block in one
pass in `block_draft`, prompt lookup in `lookup`, its looked-up path also from a datastore of
the target's own answers in `datastore`), its stats, the cost model and the choice of gamma
(`cost`), and the CLI (`specdec decode`, in
`__main__.py`)."""

from ..sampling import GREEDY, SamplingConfig
from .cost import SpeedProfile, choose_gamma
from .datastore import Datastore
from .drafters import BlockDrafter, Drafter, DraftModel, HeadDrafter, Lookup, TreeDrafter
from .speculative import DecodeOptions, generate
from .stats import DecodeStats
from .tree import TreeSpec

__all__ = ["GREEDY", "BlockDrafter", "Datastore", "DecodeOptions", "DecodeStats", "DraftModel", "Drafter",
           "HeadDrafter", "Lookup", "SamplingConfig", "SpeedProfile", "TreeDrafter", "TreeSpec", "choose_gamma",
           "generate"]
