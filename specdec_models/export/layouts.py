"""Serving layouts: how another server's model directory holds a draft head, as data, and the one
writer and reader that apply it to any head kind.

A head kind names its weights once (`heads.weights.WeightTable`, e.g. `heads.eagle3.EAGLE3_WEIGHTS`:
canonical name = the `state_dict` key). A `Layout` is, for one head kind and one server:

- `names`: a `NameMap`, canonical name -> the layout's name, as prefix rules (`Rename`); a rule
  may carry a layer index `{i}` with an offset, for a layout that numbers the head's layers
  otherwise; a name no rule matches keeps its name;
- `numbering`: a `TapNumbering`, how the layout numbers the target layers the head taps (its aux
  layers), relative to specdec's Hugging Face `hidden_states` indices, and which it can express;
- `write_config` / `read_config` / `recognize`: its config.json, written from a head, read back
  into the head's config for a target, and told apart from other layouts' configs.

`rename(tensors, names, to_layout=...)` is the one function that applies a name map, in either
direction; `save_layout` writes a head with it and `read_layout` reads a directory back to
canonical names. A `HeadKind` gathers a head kind's layouts with its builder (the head from its
config and canonical tensors), and `save_head`, `detect` and `load_head` serve every head kind in
specdec's own layout and its foreign ones. A new head kind adds its table, one `Layout` per server
(a name map, a config writer and reader) and its builder: `export.eagle3.EAGLE3` is eagle3's.

A layout directory holds `config.json`, `model.safetensors` (header metadata {"format": "pt"}) and
`SHA256SUMS`, the weights' sha256 as `sha256sum` writes it (`export.checksums`: the loader verifies
it when it is there, as specdec's own export verifies its recorded hash; a head another trainer
wrote has none and loads unchecked), written atomically: built beside the destination and renamed
over it whole (`files.staged_dir`). An existing directory is replaced only when it is empty or
holds the same layout's head of the same config (dtype aside); anything else needs `force=True`
(`--force`). specdec's own layout, the canonical names in specdec's export format, is
`export.specdec.save_export`'s.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import SpecdecError, check
from ..files import TMP_PREFIX, check_writable_dir, one_line, os_error, staged_dir
from ..heads.weights import WeightTable
from ..hf.adapter import is_hf_model
from .checksums import check_checksums, write_checksums
from .specdec import CONFIG_NAME, FORMAT, load_export, read_json_object, save_export

WEIGHTS_NAME = "model.safetensors"
FORCE = "force=True, --force"
_DTYPE_KEYS = ("torch_dtype", "dtype")
_INDEX = "{i}"
T = TypeVar("T")


# ------------------------------------------------------------------------------ weight names

@dataclass(frozen=True)
class Rename:
    """Names starting with `canonical` start with `layout` in the layout (and back). Either both
    prefixes hold one `{i}` (a layer index: the layout's is the canonical one + `offset`) or
    neither does."""

    canonical: str
    layout: str
    offset: int = 0

    def __post_init__(self) -> None:
        counts = (self.canonical.count(_INDEX), self.layout.count(_INDEX))
        check(counts in ((0, 0), (1, 1)), f"a name rule holds one {_INDEX} on both sides or on neither: {self}")
        check(counts == (1, 1) or self.offset == 0, f"a name rule without {_INDEX} has no index offset: {self}")


def _pattern(prefix: str) -> re.Pattern:
    return re.compile(re.escape(prefix).replace(re.escape(_INDEX), r"(\d+)"))


def _fill(prefix: str, index: int | None) -> str:
    return prefix if index is None else prefix.replace(_INDEX, str(index))


@dataclass(frozen=True)
class NameMap:
    """A layout's weight names: canonical -> layout by the first `Rename` whose prefix matches, in
    order; a name no rule matches is the same in both. No rules: the canonical names."""

    rules: tuple[Rename, ...] = ()

    def convert(self, name: str, to_layout: bool) -> str:
        """`name` in the layout (`to_layout`) or back in canonical names."""
        for rule in self.rules:
            source, target = (rule.canonical, rule.layout) if to_layout else (rule.layout, rule.canonical)
            found = _pattern(source).match(name)
            if found is None:
                continue
            index = None
            if found.groups():
                index = int(found.group(1)) + (rule.offset if to_layout else -rule.offset)
                if index < 0:
                    continue
            return _fill(target, index) + name[found.end():]
        return name


def rename(tensors: dict[str, T], names: NameMap, *, to_layout: bool, where: str = "the weights") -> dict[str, T]:
    """`tensors` under the layout's names (`to_layout`) or back under the canonical ones, in the
    same order: the one place a name map is applied. Two names that land on one are refused in
    one line (`where` names the weights)."""
    out: dict[str, T] = {}
    came_from: dict[str, str] = {}
    for name, value in tensors.items():
        new = names.convert(name, to_layout)
        check(new not in out, f"{where}: {came_from.get(new)} and {name} both name {new}")
        out[new] = value
        came_from[new] = name
    return out


# ------------------------------------------------------------------------------ tap numbering

@dataclass(frozen=True)
class TapNumbering:
    """How a layout numbers the target layers a head taps. specdec numbers a tap by its Hugging
    Face `hidden_states` index i (the input of decoder layer i, 0 the embeddings); the layout's id
    is i + `offset`, and it can express indices `first`..L + `last` of an L-layer target. `count`:
    how many taps the layout's head fuses (None: any); `reader` names who reads the ids (errors)."""

    offset: int = 0
    first: int = 0
    last: int = 0
    count: int | None = None
    reader: str = "the layout"

    def to_layout(self, indices: list[int], target_layers: int) -> list[int]:
        """The layout's ids of the `hidden_states` indices `indices`; one line where it cannot hold them."""
        check(self.count is None or len(indices) == self.count,
              f"{self.reader} fuses exactly {self.count} aux layers, the head has {len(indices)} ({indices})")
        low, high = self.first, target_layers + self.last
        for i in indices:
            check(low <= i <= high, f"aux layer {i} (hidden_states index) cannot be captured by {self.reader}, which "
                                    f"captures hidden_states indices {low}..{high} (its ids {low + self.offset}.."
                                    f"{high + self.offset})")
        return [i + self.offset for i in indices]

    def from_layout(self, ids: list[int]) -> list[int]:
        """The `hidden_states` indices of the layout's ids (a list of integers, else one line)."""
        check(isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids),
              f"the aux-layer ids must be a list of integers, got {ids!r}")
        return [i - self.offset for i in ids]


# ------------------------------------------------------------------------------ a layout

@dataclass(frozen=True)
class Layout:
    """One server's layout of one head kind (module docstring). `write_config(head, layout, **options)`
    gives config.json (`options`: the keywords it takes); `read_config(config, target, layout, where)`
    the head's config for `target`, refusing in one line what the head cannot compute (both number
    the taps by `layout.numbering`); `recognize(config)` whether a config.json is this layout's, and
    `what` what it then holds ("a speculators eagle3 model", for errors). `ignored`: layout names a
    loader reads and drops (a server's copies of the target's weights). `omit_with_full_vocab`: the
    canonical names the layout leaves out when the head drafts over the whole target vocabulary
    (None: the table's vocabulary maps, then the identity); a reader then rebuilds them.
    `settings`: a config.json less its serving settings (speculators' tokens per step), which a new
    export of the same head may change in place (None: the config has none). `stored(head, tensors)`:
    the head's canonical tensors as the layout stores them, before renaming, for a layout that
    reshapes or merges a weight (speculators' P-EAGLE: `export.peagle`); None: as they are."""

    name: str
    table: WeightTable
    names: NameMap
    write_config: Callable[..., dict[str, Any]]
    read_config: Callable[[dict[str, Any], Any, Layout, str], Any]
    recognize: Callable[[dict[str, Any]], bool]
    what: str
    numbering: TapNumbering = field(default_factory=TapNumbering)
    options: tuple[str, ...] = ()
    ignored: frozenset[str] = frozenset()
    omit_with_full_vocab: frozenset[str] | None = None
    settings: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    stored: Callable[[Any, dict[str, Tensor]], dict[str, Tensor]] | None = None


def layout_tensors(head: Any, layout: Layout) -> dict[str, Tensor]:
    """The weights of `head` (its `state_dict`, which must be its table's) under the layout's names,
    on the CPU and contiguous; with a full draft vocabulary, less the layout's `omit_with_full_vocab`;
    through the layout's `stored` where it has one."""
    state = head.state_dict()
    table = layout.table
    check(set(state) == set(table.names), f"the {table.kind} head's weights ({', '.join(state)}) are not its "
                                          f"weight table's ({', '.join(table.names)})")
    omitted = table.vocab_maps if layout.omit_with_full_vocab is None else layout.omit_with_full_vocab
    drop = omitted if table.full_vocab(head.config) else frozenset()
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items() if name not in drop}
    if layout.stored is not None:
        tensors = {name: t.contiguous() for name, t in layout.stored(head, tensors).items()}
    return rename(tensors, layout.names, to_layout=True, where=f"the {layout.name} layout")


# ------------------------------------------------------------------------------ writing

def save_layout(directory: str | os.PathLike, head: Any, layout: Layout, *, force: bool = False,
                **options: Any) -> Path:
    """Write `head` into `directory` in `layout` (config.json, model.safetensors and its SHA256SUMS,
    atomically; module docstring) and return its path. `options` go to the layout's config writer.
    Refuses (one line) a directory holding another model unless `force`."""
    unknown = sorted(set(options) - set(layout.options))
    check(not unknown, f"{', '.join(f'{k}=' for k in unknown)} is not an option of the {layout.name} layout "
                       f"(it takes {', '.join(layout.options) or 'none'})")
    config = layout.write_config(head, layout, **options)
    tensors = layout_tensors(head, layout)
    directory = Path(directory)
    check_replaceable(directory, layout.name, config, force, layout.settings)
    check_writable_dir(directory.parent, "export directory")
    text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    try:
        with staged_dir(directory) as tmp:
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / CONFIG_NAME).write_text(text, encoding="utf-8")
            for name in (WEIGHTS_NAME, CONFIG_NAME):
                with open(tmp / name, "rb+") as f:
                    os.fsync(f.fileno())
            write_checksums(tmp, [WEIGHTS_NAME])
    except OSError as error:
        raise os_error(error, f"cannot write the {layout.name} head to {directory}") from None
    return directory


def _identity(config: dict[str, Any], settings: Callable[[dict[str, Any]], dict[str, Any]] | None) -> dict[str, Any]:
    config = {k: v for k, v in config.items() if k not in _DTYPE_KEYS}
    return config if settings is None else settings(config)


def check_replaceable(directory: Path, layout: str, config: dict[str, Any], force: bool,
                      settings: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """May a head in `layout` with `config` replace `directory`? Yes when it does not exist, is
    empty, or holds the same layout's head of the same config (dtype and the serving `settings`
    aside: `Layout.settings`); else only with force."""
    check(not directory.exists() or directory.is_dir(), f"export path {directory} exists and is not a directory")
    if force or not directory.is_dir():
        return
    others = sorted(p.name for p in directory.iterdir() if not p.name.startswith(TMP_PREFIX))
    if not others:
        return
    existing = None
    try:
        existing = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    same = isinstance(existing, dict) and _identity(existing, settings) == _identity(config, settings)
    if not same:
        held = describe(existing) if isinstance(existing, dict) else f"files ({', '.join(others[:3])})"
        raise SpecdecError(f"{directory} holds {held}, not this {layout} head: choose another directory, or "
                           f"replace it whole on purpose ({FORCE})")


def describe(config: dict[str, Any]) -> str:
    """What a config.json holds, in a few words: a specdec export, a speculators model, an architecture."""
    if config.get("format") == FORMAT:
        return f"a specdec {config.get('kind')} export"
    if "speculators_model_type" in config:
        return f"a speculators {config['speculators_model_type']} model"
    archs = config.get("architectures") or ["an unnamed architecture"]
    return f"a {archs[0]} model"


# ------------------------------------------------------------------------------ reading

def read_config(directory: Path, layout: Layout, target: Any, what: str) -> Any:
    """The head's config from `directory`'s config.json in `layout`, for `target`; every refusal one
    line starting with the file and the layout (`what`: the kind of directory expected)."""
    config = read_json_object(directory / CONFIG_NAME, f"give {what}")
    where = f"{directory / CONFIG_NAME} ({layout.name} layout)"
    try:
        return layout.read_config(config, target, layout, where)
    except (TypeError, ValueError) as error:
        if isinstance(error, SpecdecError) and str(error).startswith(where):
            raise
        raise SpecdecError(f"{where}: {one_line(error)}") from None


def read_layout(directory: Path, layout: Layout) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The weights in `directory` (every .safetensors file; pickles refused) under canonical names:
    (the head's, the layout's `ignored` ones)."""
    tensors = rename(read_weights(directory), layout.names, to_layout=False, where=str(directory))
    ignored = {k: v for k, v in tensors.items() if k in layout.ignored}
    return {k: v for k, v in tensors.items() if k not in layout.ignored}, ignored


def read_weights(directory: Path) -> dict[str, Tensor]:
    """Every tensor of the .safetensors files in `directory`, by its name in the files, after
    checking them against the folder's SHA256SUMS when it has one (`export.checksums`)."""
    files = sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))
    if not files:
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        check(not pickled, f"{directory} holds {', '.join(pickled)}: specdec reads no pickle; convert the weights to "
                           f"safetensors")
        raise SpecdecError(f"{directory} holds no .safetensors weights")
    check_checksums(directory, [p.name for p in files])
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            part = load_file(str(path), device="cpu")
        except Exception as error:  # noqa: BLE001  safetensors raises its own error types for a corrupt file
            raise SpecdecError(f"cannot read weights file {path} ({one_line(error)})") from None
        twice = sorted(set(part) & set(tensors))
        check(not twice, f"{directory}: tensors {', '.join(twice[:3])} appear in more than one weights file")
        tensors.update(part)
    return tensors


# ------------------------------------------------------------------------------ a head kind in every layout

SPECDEC = "specdec"     # specdec's own layout: the canonical names in specdec's export format (export.specdec)


@dataclass(frozen=True)
class HeadKind:
    """A head kind as the export sees it: its class (`head_type`), its kind in specdec's own format
    (`export_kind`, e.g. "hf_eagle3"), the foreign layouts it is served in, and `build(config,
    target, tensors, copies, directory)`, which makes the head, in eval mode, from its config (a
    layout's `read_config`) and its canonical tensors (`read_layout`), checking them in one line."""

    name: str
    head_type: type
    export_kind: str
    layouts: tuple[Layout, ...]
    build: Callable[[Any, Any, dict[str, Tensor], dict[str, Tensor], Path], Any]

    @property
    def layout_names(self) -> tuple[str, ...]:
        """"specdec" and the foreign layouts' names."""
        return (SPECDEC, *(layout.name for layout in self.layouts))

    def layout(self, name: str) -> Layout:
        """The foreign layout `name`."""
        return next(layout for layout in self.layouts if layout.name == name)


def save_head(directory: str | os.PathLike, head: Any, kind: HeadKind, layout: str = SPECDEC, *,
              target_path: str | os.PathLike | None = None, metadata: dict[str, Any] | None = None,
              force: bool = False, **options: Any) -> Path:
    """Write `head` of `kind` into `directory` in `layout` and return its path: specdec's own
    (`save_export`, recording `target_path` and `metadata`) or a foreign one (`save_layout`, the
    layout's `options`). Refuses (one line) a directory holding another model unless `force`."""
    check(isinstance(head, kind.head_type), f"can only write an {kind.head_type.__name__} in an {kind.name} layout, "
                                            f"got {type(head).__name__}")
    check(layout in kind.layout_names, f"layout must be one of {', '.join(kind.layout_names)}, got {layout!r}")
    if layout == SPECDEC:
        check(not options, f"{', '.join(f'{k}=' for k in options)} is not an option of specdec's layout, which "
                           f"records target_path=")
        return save_export(directory, head, target_path=target_path, metadata=metadata, force=force)
    check(metadata is None, f"the {layout} layout has no place for metadata")
    check(target_path is None, f"the {layout} layout records no target path")
    return save_layout(directory, head, kind.layout(layout), force=force, **options)


def detect(directory: str | os.PathLike, kind: HeadKind) -> str:
    """Which of `kind`'s layouts the head in `directory` has (one-line `SpecdecError` for anything else)."""
    directory = Path(directory)
    check(directory.is_dir(), f"{kind.name} head directory {directory} does not exist")
    path = directory / CONFIG_NAME
    check(path.is_file(), f"{path} is missing: {directory} holds no {kind.name} head "
                          f"({', '.join(kind.layout_names)} layout)")
    config = read_json_object(path, f"give an {kind.name} head directory")
    if config.get("format") == FORMAT:
        check(config.get("kind") == kind.export_kind, f"{directory} holds a specdec {config.get('kind')} export, "
                                                      f"not an {kind.name} head (kind {kind.export_kind})")
        return SPECDEC
    found = [layout.name for layout in kind.layouts if layout.recognize(config)]
    if found:
        return found[0]
    check("speculators_model_type" not in config, f"{directory} holds {describe(config)}, not an {kind.name} head")
    raise SpecdecError(f"{directory} is neither a specdec {kind.export_kind} export, nor "
                       f"{', nor '.join(layout.what for layout in kind.layouts)} (architectures "
                       f"{config.get('architectures') or []})")


def load_head(directory: str | os.PathLike, target: Any, kind: HeadKind) -> Any:
    """The head of `kind` in `directory` (any of its layouts, `detect`) attached to the Hugging Face
    causal LM `target`, in eval mode; a head for another target, or one the head kind cannot
    compute, is refused in one line."""
    directory = Path(directory)
    name = detect(directory, kind)
    check(is_hf_model(target), f"the target of the {kind.name} head in {directory} must be a Hugging Face causal LM, "
                               f"got {type(target).__name__}")
    if name == SPECDEC:
        return load_export(directory, target=target)
    layout = kind.layout(name)
    config = read_config(directory, layout, target, f"an {kind.name} head directory")
    tensors, copies = read_layout(directory, layout)
    return kind.build(config, target, tensors, copies, directory)


__all__ = ["SPECDEC", "HeadKind", "Layout", "NameMap", "Rename", "TapNumbering", "check_replaceable", "describe",
           "detect", "layout_tensors", "load_head", "read_config", "read_layout", "read_weights", "rename", "save_head",
           "save_layout"]
