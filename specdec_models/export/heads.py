"""Any head kind's export, told apart by what it holds: one table of the head kinds a Hugging Face
target decodes with, and the one loader the evaluation and the recipe call.

`HEADS` maps a head kind's name ("eagle3", "dflash", "peagle") to its `layouts.HeadKind` (its class, its kind
in specdec's own format, its foreign layouts and its builder); a new head kind is one more row.
`detect_head(DIR)` reads only config.json and returns the kind and the layout it holds: specdec's own
export by its `kind` field ("hf_eagle3" -> eagle3), a foreign layout by the first kind whose layout
recognizes it (`Layout.recognize`). `load_any_head(DIR, target)` loads it onto the Hugging Face
causal LM `target` (`layouts.load_head`: the same checks as each kind's own loader, e.g.
`eagle3.load_eagle3`). A directory that holds no head of these kinds is one line (`SpecdecError`),
naming the kinds and layouts it could have held.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import SpecdecError, check
from .dflash import DFLASH
from .eagle3 import EAGLE3
from .layouts import SPECDEC, HeadKind, describe, load_head
from .peagle import PEAGLE
from .specdec import CONFIG_NAME, FORMAT, read_json_object

# the head kinds an evaluation or a recipe loads, by name: a new head kind is one row
HEADS: dict[str, HeadKind] = {kind.name: kind for kind in (EAGLE3, DFLASH, PEAGLE)}


class FoundHead(NamedTuple):
    """What a head directory holds: its kind (a `HEADS` value) and its layout ("specdec" or a
    foreign layout's name)."""

    kind: HeadKind
    layout: str


def known_heads() -> str:
    """The kinds and their layouts in words, for errors: "eagle3 (specdec, speculators or sglang
    layout), dflash (specdec or speculators layout), peagle (specdec layout)"."""
    def layouts(kind: HeadKind) -> str:
        names = kind.layout_names
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return ", ".join(f"{name} ({layouts(kind)} layout)" for name, kind in HEADS.items())


def detect_head(directory: str | os.PathLike) -> FoundHead:
    """The head kind and layout the head in `directory` has, from its config.json alone (module
    docstring); anything else is one line."""
    directory = Path(directory)
    check(directory.is_dir(), f"head directory {directory} does not exist")
    path = directory / CONFIG_NAME
    check(path.is_file(), f"{path} is missing: {directory} holds no head of a known kind: {known_heads()}")
    config = read_json_object(path, "give a head directory")
    if config.get("format") == FORMAT:
        by_export = {kind.export_kind: kind for kind in HEADS.values()}
        kind = by_export.get(config.get("kind"))
        check(kind is not None, f"{directory} holds a specdec {config.get('kind')} export, not a head of a known kind "
                                f"(specdec kinds {', '.join(by_export)})")
        return FoundHead(kind, SPECDEC)
    for kind in HEADS.values():
        found = [layout.name for layout in kind.layouts if layout.recognize(config)]
        if found:
            return FoundHead(kind, found[0])
    check("speculators_model_type" not in config, f"{directory} holds {describe(config)}, not a head of a known "
                                                  f"kind: {known_heads()}")
    raise SpecdecError(f"{directory} holds {describe(config)}, no head of a known kind: it is neither a specdec "
                       f"export of {', '.join(k.export_kind for k in HEADS.values())}, nor "
                       f"{', nor '.join(layout.what for k in HEADS.values() for layout in k.layouts)}")


def load_any_head(directory: str | os.PathLike, target: Any) -> Any:
    """The head in `directory`, of whichever kind and layout it holds (`detect_head`), attached to
    the Hugging Face causal LM `target`, in eval mode; a head for another target is one line."""
    return load_head(directory, target, detect_head(directory).kind)


__all__ = ["HEADS", "PEAGLE", "FoundHead", "detect_head", "known_heads", "load_any_head"]
