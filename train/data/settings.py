"""Many plain settings in one typed dataclass: how a class that Hydra or Lightning builds from flat
keyword values keeps a short signature.

A DataModule (`data:`), a callback (`callbacks.*`) or a LightningModule (the hyper-parameters a
checkpoint records, which `load_from_checkpoint` and `train.checkpoints.load_module` pass back as
keywords) is built from flat plain values, so its config and its checkpoints stay as they are. Such
a class takes `**settings` and reads them with `read_settings` into a frozen dataclass that names
each setting once, with its type, default and checks; the dataclass's docstring is the class's
API. It lives in the data package, which imports nothing else of train, so the DataModules use it
as the callbacks and the tasks (which import the data package) do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def read_settings(cls: type[T], owner: type, given: dict[str, Any]) -> T:
    """`cls(**given)`, the settings dataclass of the class `owner`. A key `cls` has no field for is
    the TypeError that `owner(**given)` raises for a keyword its signature lacks, in its words
    (Hydra and `train.run` report it as such: "X.__init__() got an unexpected keyword argument")."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [key for key in given if key not in names]
    if unknown:
        raise TypeError(f"{owner.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}")
    return cls(**given)
