"""A head's weight table: every tensor a draft head saves, named once.

The canonical name of a weight is its key in the head's `state_dict`. A head kind's module
holds one `WeightTable` (`heads.eagle3.EAGLE3_WEIGHTS`): each weight's canonical name, its
shape in the head's sizes (named sizes, e.g. ("H", "AH"), with the table's `sizes(config)`
giving their values) and what it holds. The serving layouts (`specdec_models.export.layouts`)
rename these names and nothing else, so a weight a head gains is written in one place, the table,
and every layout carries it; a test checks each table against its head's `state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import check


@dataclass(frozen=True)
class Weight:
    """One tensor of a head: `name` canonical (the `state_dict` key), `shape` in named sizes,
    `meaning` what it holds. `vocab_map`: a map between the draft vocabulary ("D") and the target's
    ("V"), the identity when they agree, so a layout may leave it out then."""

    name: str
    shape: tuple[str, ...]
    meaning: str
    vocab_map: bool = False


@dataclass(frozen=True)
class WeightTable:
    """Every weight of a head kind (`kind`, e.g. "eagle3"), in `state_dict` order; `sizes(config)`
    gives the named sizes of the shapes for the head's config."""

    kind: str
    weights: tuple[Weight, ...]
    sizes: Callable[[Any], dict[str, int]]

    def __post_init__(self) -> None:
        names = [w.name for w in self.weights]
        check(len(set(names)) == len(names), f"the {self.kind} weight table names a weight twice")

    @property
    def names(self) -> list[str]:
        """The canonical names, in `state_dict` order."""
        return [w.name for w in self.weights]

    @property
    def vocab_maps(self) -> frozenset[str]:
        """The canonical names of the vocabulary maps (`Weight.vocab_map`)."""
        return frozenset(w.name for w in self.weights if w.vocab_map)

    def full_vocab(self, config: Any) -> bool:
        """Whether a head with `config` drafts over the whole target vocabulary (its sizes "D", the
        draft vocabulary, and "V", the target's, agree): its vocabulary maps are then the identity."""
        sizes = self.sizes(config)
        return "D" in sizes and sizes["D"] == sizes.get("V")

    def shapes(self, config: Any) -> dict[str, tuple[int, ...]]:
        """{canonical name: shape} of a head with `config`."""
        sizes = self.sizes(config)
        return {w.name: tuple(sizes[s] for s in w.shape) for w in self.weights}


__all__ = ["Weight", "WeightTable"]
