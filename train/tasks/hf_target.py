"""The frozen Hugging Face target a head trains against: what every head task on one shares.

task=hf_prophet and task=hf_eagle3 train a head on a frozen Hugging Face causal LM (the target),
loaded from a local model directory or a GGUF file (`specdec_models.hf.weights`):

- `HFTarget`: the `target:` node (path, dtype, `shard`), and `check_head_kind` for `head.kind`;
- `load_target`: the target in eval mode without gradient and the sha256 of its weights, loaded
  once per process, whole or lean (the embedding, final norm, LM head and the decoder layers a
  head trained from a cache reads: `specdec_models.hf.lean`); `forget_loaded` drops that load;
- `check_target`: what each such task's `validate` checks first (the `target:` node, the data's
  tokenizer against the target's, `target.shard`), and the load that identifies the weights;
- `HFTargetHead`: the mix-in of their TaskModules: the target held outside the module
  (`FrozenModel`, or `ShardedFrozenModel` with target.shard: `train.tasks.sharding`), reloaded
  and checked against the run's hash, the head decoding with the whole target, its export.

task=hf_draft_distill's teacher is a whole Hugging Face model identified by its directory's
fingerprint (`specdec_models.hf.model_dir_fingerprint`), not by hashing its weights: it keeps its
own loader.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from specdec_models.config import DTYPES, from_dict, torch_dtype
from specdec_models.errors import check
from specdec_models.hf import HFDecoder
from specdec_models.hf.lean import LeanUnavailable, lean_causal_lm
from specdec_models.hf.weights import check_same_tokenizer, check_source, load_causal_lm, load_tokenizer, weights_sha256

from ..data.hf_embeddings import HFEmbeddingsDataModule
from .base import FrozenModel, SpeculativeModels, data_class, required, to_plain
from .sharding import ShardedFrozenModel, check_shard

HOW_TO_GIVE = "DIR or FILE.gguf (a local Hugging Face causal LM directory or a GGUF file)"


@dataclass(frozen=True)
class HFTarget:
    """The `target:` node: the frozen Hugging Face model the head drafts for; `shard`: split it
    across the processes of an online data-parallel run (`train.tasks.sharding`)."""

    path: str | None = None
    dtype: str = "float32"            # the target only runs forward passes; the head trains in float32
    shard: bool = False

    def __post_init__(self) -> None:
        torch_dtype(self.dtype, "target.dtype")
        check(isinstance(self.shard, bool), f"target.shard must be true or false, got {self.shard!r}")


# head.kind -> the task that trains it
HEAD_TASKS = {"prophet": "hf_prophet", "eagle3": "hf_eagle3", "dflash": "hf_dflash", "peagle": "hf_peagle"}


def check_head_kind(kind: object, expected: str) -> None:
    """`head.kind` names the head a Hugging Face head task trains: one line when it names another."""
    check(kind in HEAD_TASKS, f"head.kind must be one of {', '.join(HEAD_TASKS)}, got {kind!r}")
    check(kind == expected, f"head.kind={kind} is trained by task={HEAD_TASKS[kind]} (experiment={HEAD_TASKS[kind]}); "
                            f"this run's task={HEAD_TASKS[expected]} trains head.kind={expected}")


_LOADED: dict[tuple, tuple[Any, str]] = {}


def load_target(path: str | Path, dtype: str, layers: list[int] | None = None) -> tuple[Any, str]:
    """(the target in eval mode without gradient, the sha256 of its weights), loaded once per
    process for its path, dtype, files (name, size, mtime) and parts: `validate` and the module share
    one load (a real target takes tens of seconds). `layers=None`: the whole model; a list: the
    lean model a head trained from a cache reads (`specdec_models.hf.lean`: embedding, final norm,
    LM head and those decoder layers), or the whole model, said in a warning, where the checkpoint
    cannot be read tensor by tensor."""
    source = check_source(path, "target.path")
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    parts = None if layers is None else tuple(sorted(layers))
    key = (str(source.resolve()), dtype, tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files), parts)
    if key not in _LOADED:
        for old in [k for k in _LOADED if k[:3] != key[:3]]:
            del _LOADED[old]                             # one target at a time (its lean and whole forms)
        model = None
        if parts is not None:
            try:
                model = lean_causal_lm(source, dtype=DTYPES[dtype], layers=list(parts), what="target.path")
            except LeanUnavailable as why:
                warnings.warn(f"target.path: loading the whole target, as {why}", stacklevel=2)
        if model is None:
            model = load_causal_lm(source, dtype=DTYPES[dtype], what="target.path")
        model.requires_grad_(False)
        _LOADED[key] = (model, weights_sha256(model))
    return _LOADED[key]


def forget_loaded() -> None:
    """Drop the target `load_target` holds (a sharded run frees the whole one once it is split)."""
    _LOADED.clear()


class HFTargetHead:
    """What a module training a head on a frozen Hugging Face target shares (mixed into the
    TaskModules of hf_prophet and hf_eagle3): `self.head` and hyper-parameters `target_path`,
    `weights_sha256`, `target_dtype` and `cache_layers`. In `__init__`:
    `self._target = self._frozen_target(target_shard)` (the whole target: online hidden states, the
    evaluation callback's decoding) and `self._parts` (what the head is built on: from a cache,
    `FrozenModel(self._load_parts)`, the lean target of `head_layers()`; online, `self._target`)."""

    def _frozen_target(self, shard: bool) -> FrozenModel:
        """The holder of the frozen target; with `shard` (target.shard) one that `on_fit_start` splits."""
        return ShardedFrozenModel(self._load_target, forget=forget_loaded) if shard else FrozenModel(self._load_target)

    def on_fit_start(self) -> None:
        """With target.shard, split the target across the processes: every rank runs this hook, once
        Lightning has set up the process group and moved the module to its device."""
        super().on_fit_start()
        if isinstance(self._target, ShardedFrozenModel):
            self._target.shard(self.device)

    def head_layers(self) -> list[int]:
        """The target's decoder layers the head reads besides its embedding, norm and LM head."""
        return []

    def _checked(self, layers: list[int] | None) -> Any:
        path, expected = self.hparams.target_path, self.hparams.weights_sha256
        model, sha = load_target(path, self.hparams.target_dtype, layers)
        check(sha == expected, f"target.path {path} now holds other weights (sha256 {sha[:16]}...) than this run's "
                               f"target ({expected[:16]}...): restore it or start a new run")
        return model

    def _load_target(self) -> Any:
        return self._checked(None)

    def _load_parts(self) -> Any:
        return self._checked(self.head_layers())

    @property
    def target(self) -> Any:
        """The whole frozen target, on the module's device (loaded on first use)."""
        return self._target.get(self.device)

    @property
    def parts(self) -> Any:
        """The target the head reads (lean from a cache), on the module's device."""
        return self._parts.get(self.device)

    def speculative_models(self) -> SpeculativeModels:
        """The whole target (on the head's vocabulary) drafted by the head: a head trained on the
        lean target decodes as a copy of its weights on the whole one (decoding runs the target)."""
        target, head = self.target, self.head
        if head.target is not target:
            head = self.head_on(target)
        return SpeculativeModels(target=HFDecoder(target, head.vocab_size), prophet=head)

    def head_on(self, target: Any) -> nn.Module:
        """A copy of the head (its weights, dtype and device) built on another load of its target."""
        raise NotImplementedError

    def export_model(self) -> Any:
        _ = self.parts                                                     # the head hashes its target's weights
        return self.head

    def export_options(self) -> dict[str, Any]:
        return {"target_path": self.hparams.target_path}


def check_target(cfg: DictConfig, layers: list[int] | None = None) -> tuple[HFTarget, Path, Any, Any, str, bool]:
    """What the validate() of every head on a Hugging Face target checks: `target:`, the data's
    tokenizer against the target's (unless the data is a cache); then it loads the target
    (`load_target`: from a cache, the lean target with decoder `layers`). Returns (target config,
    its path, its tokenizer, the model, its weights' sha256, whether the data is a cache)."""
    target = from_dict(HFTarget, to_plain(cfg.get("target")), "target")
    path = check_source(required(cfg, "target.path", HOW_TO_GIVE), "target.path")
    tokenizer = load_tokenizer(path, "target.path")
    cached = issubclass(data_class(cfg), HFEmbeddingsDataModule)
    check_shard(cfg, target.shard, cached)
    data_tokenizer = OmegaConf.select(cfg, "data.tokenizer", throw_on_resolution_failure=False)
    check(cached or data_tokenizer, "data.tokenizer is not set or does not resolve: set data.tokenizer=${target.path}")
    if data_tokenizer and Path(str(data_tokenizer)).expanduser().resolve() != path.resolve():
        check_same_tokenizer(tokenizer, load_tokenizer(data_tokenizer, "data.tokenizer"), f"target.path {path}",
                             f"data.tokenizer {data_tokenizer}")
    model, sha = load_target(path, target.dtype, (layers or []) if cached else None)
    return target, path, tokenizer, model, sha, cached
