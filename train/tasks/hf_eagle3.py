"""task=hf_eagle3: an EAGLE-3-class head trained against a frozen Hugging Face target.

`specdec train experiment=smollm2_eagle3 data.cache=DIR head.draft_vocab=COUNTS.json` (from a
cache of the target's hidden states, `data=hf_embeddings`), or online (the target runs under
no_grad at every step) from conversations (`data=hf_chat data.answers=DIR`, `train.data.chat_rows`)
or plain text (`data=hf_text data.files=[...]`). The head is
`specdec_models.heads.eagle3.Eagle3Head`: a fc over three aux layers, one decoder layer at the target's
shapes attending over the whole context, an LM head over a draft vocabulary; it shares (frozen)
the target's token embedding.

Training runs as decoding does (`Eagle3Head.ttt_loss`): `task.ttt_steps` unrolled draft steps, each
fed the head's own features of the step before, weighted `task.ttt_decay`^k; the loss is the
forward KL from the target's distribution renormalised over the draft vocabulary (the module
docstring of `specdec_models.heads.eagle3` says why renormalising is the right handling of the mass
outside it). Only answer tokens count: for conversation rows, the labels of every token outside an
assistant turn are masked (`loss_mask`); for rows of one prompt and its continuation, those of the
prompt and of everything after the row's end (`prompt_len`, `valid_len` of the cache).
`task.ttt_ramp`: the share of the budget (the larger of the steps' and `max_time`'s share, as the
schedule reads it) whose training steps unroll draft step 1 alone, at about a third of a 4-step
step's cost, before the rest unrolls all `ttt_steps` (on in experiment=smollm2_eagle3, where the
first position bounds every later one). `task.feature_weight` adds the
smooth-L1 distance between the head's normed output and the target's normed last layer at the
label; `task.feature_noise` adds noise of that many times each aux layer's RMS to its hidden
states in training (both off: neither moved the held-out figures).

Draft vocabulary: the `head.draft_vocab_size` tokens the target emits most as its greedy choice
on the training data, from a token-count file written by `specdec draft-vocab` (which also
reports coverage and the draft cost c per size); the file records the tokenizer it counted with,
and another target's is refused in one line. `head.draft_vocab_size: null` keeps the whole
vocabulary (no file needed). `head.train_lm_head`: the LM head's rows start from the target's and
train, or stay frozen. `head.init_layer`: the decoder layer starts as the target's layer that reads
the highest aux layer, the fc as the identity on it (`Eagle3Head.init_layer_from`; off by default,
on in experiment=smollm2_eagle3, where it lowered the held-out KL from the first validation on).
`head.init_from=EXPORT`: the head starts from an hf_eagle3 export's weights (its draft vocabulary
too; they replace any start `head.init_layer` chose) and trains on, with a fresh optimizer and
schedule: more data and steps for a head trained before. The export must be for this target and of
this head's shapes; the run's export records where it started.

`train/loss` and `val/loss` are one quantity: the loss per unrolled step (the weighted sum over
the steps the training unrolls at that point, divided by the sum of their weights), so during
the ramp both read one step and after it all `ttt_steps`; `val/loss_all_steps` is the same over all
`ttt_steps` at every validation (the checkpoint's monitor: it means the same before and after the
ramp). Validation logs per step k the KL, the teacher-forced accuracy given every earlier step right
(`val/ttt_accuracy/pos{k+1}`: exact for greedy decoding, a greedy token outside the draft
vocabulary counting as a miss) and the simulated tokens per call they imply, beside the
evaluation callback's real ones; `val/draft_vocab_mass` is the target's probability inside the
draft vocabulary. The export is the head with its target's identity (kind hf_eagle3).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from safetensors import safe_open
from torch import nn

from specdec_models.config import from_dict
from specdec_models.errors import SpecdecError, check, check_positive_int
from specdec_models.export import read_export_config, read_export_tensors
from specdec_models.files import one_line
from specdec_models.heads.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    choose_draft_vocab,
    default_aux_layers,
    init_layer_index,
)
from specdec_models.hf import HFDecoder, load_config, logits_width, text_config
from specdec_models.hf.weights import tokenizer_fingerprint, vocabulary_fingerprint

from ..data.chat_rows import HFChatDataModule
from ..data.embeddings_cache import HOW_TO_BUILD, check_cache
from ..data.hf_embeddings import HFEmbeddingsDataModule, label_mask
from ..data.hf_text import HFTextDataModule
from ..data.settings import read_settings
from .base import FrozenModel, Task, TaskModule, required, to_plain
from .hf_target import HOW_TO_GIVE, HFTargetHead, check_head_kind, check_target

COUNTS_FORMAT = "specdec-token-counts"


@dataclass(frozen=True)
class Eagle3Options:
    """The `task:` node of task=hf_eagle3."""

    ttt_steps: int = 4            # draft steps unrolled in training (each fed the head's own features)
    ttt_decay: float = 0.8        # weight of step k: ttt_decay ** k
    tv_weight: float = 0.0        # weight of the T = 1 rejection probability TV(p, q) beside the KL
    feature_weight: float = 0.0   # weight of the smooth-L1 distance to the target's normed last layer
    ttt_ramp: float = 0.0         # share of the budget that trains draft step 1 alone, before all ttt_steps
    feature_noise: float = 0.0    # training noise on the aux hidden states, in units of each one's RMS

    def __post_init__(self) -> None:
        check_positive_int(self.ttt_steps, "task.ttt_steps")
        check(isinstance(self.ttt_decay, (int, float)) and 0 < self.ttt_decay <= 1,
              f"task.ttt_decay must be in (0, 1], got {self.ttt_decay!r}")
        for name in ("tv_weight", "feature_weight", "feature_noise"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"),
                  f"task.{name} must be a number >= 0, got {value!r}")
        check(isinstance(self.ttt_ramp, (int, float)) and not isinstance(self.ttt_ramp, bool)
              and 0 <= self.ttt_ramp < 1, f"task.ttt_ramp must be in [0, 1), got {self.ttt_ramp!r}")


def check_vocab_sizes(head: Any) -> None:
    """The `head:` fields an EAGLE-3-class head shares (eagle3's, peagle's): `draft_vocab_size`,
    `aux_layers` and `train_lm_head`, each one line when wrong."""
    if head.draft_vocab_size is not None:
        check_positive_int(head.draft_vocab_size, "head.draft_vocab_size")
    if head.aux_layers is not None:
        check(isinstance(head.aux_layers, (list, tuple)) and len(head.aux_layers) >= 1
              and all(isinstance(i, int) and not isinstance(i, bool) for i in head.aux_layers),
              f"head.aux_layers must be a list of layer indices or null, got {head.aux_layers!r}")
    check(isinstance(head.train_lm_head, bool), f"head.train_lm_head must be true or false, got {head.train_lm_head!r}")


@dataclass(frozen=True)
class Eagle3Sizes:
    """The `head:` node: its kind, aux layers (null: [2, L//2, L-3]), the draft vocabulary and its source."""

    kind: str = "eagle3"
    aux_layers: list[int] | None = None
    draft_vocab_size: int | None = 8192       # null: the target's whole vocabulary
    draft_vocab: str | None = None            # token counts (specdec draft-vocab), needed below the whole vocabulary
    train_lm_head: bool = True
    init_layer: bool = False                  # start the decoder layer (and fc) from the target's layer
    init_from: str | None = None              # an hf_eagle3 export whose weights the head starts from

    def __post_init__(self) -> None:
        check_head_kind(self.kind, "eagle3")
        check_vocab_sizes(self)
        check(isinstance(self.init_layer, bool), f"head.init_layer must be true or false, got {self.init_layer!r}")
        check(self.init_from is None or (isinstance(self.init_from, str) and self.init_from),
              f"head.init_from must be an export directory or null, got {self.init_from!r}")


# ------------------------------------------------------------------------------ token counts

def read_token_counts(path: str | Path, tokenizer: Any, vocab_size: int) -> torch.Tensor:
    """The token counts (vocab_size,) of a `specdec draft-vocab` file, checked against the
    target's tokenizer."""
    path = Path(path).expanduser()
    check(path.is_file(), f"head.draft_vocab: {path} does not exist (write it with specdec draft-vocab)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpecdecError(f"head.draft_vocab: {path} is not a token-count file: {one_line(error)}") from None
    check(isinstance(data, dict) and data.get("format") == COUNTS_FORMAT,
          f"head.draft_vocab: {path} is not a token-count file of specdec draft-vocab")
    # files written since carry the vocabulary's fingerprint, which no library version changes; older
    # ones only the tokenizer's serialized definition
    same = (data["vocabulary_sha256"] == vocabulary_fingerprint(tokenizer) if "vocabulary_sha256" in data
            else data.get("tokenizer_sha256") == tokenizer_fingerprint(tokenizer))
    check(same, f"head.draft_vocab: {path} was counted with another tokenizer than the target's: count again for "
                f"this target (specdec draft-vocab)")
    counts = data.get("counts")
    check(isinstance(counts, list) and len(counts) == vocab_size,
          f"head.draft_vocab: {path} holds {len(counts) if isinstance(counts, list) else 'no'} counts, the target's "
          f"vocabulary has {vocab_size} tokens")
    return torch.tensor(counts, dtype=torch.long)


# ------------------------------------------------------------------------------ a head to start from

def read_start_export(path: str, weights_sha256: str, head: Eagle3Config) -> tuple[dict[str, Any], list[int]]:
    """(config.json, draft vocabulary ids) of the hf_eagle3 export `head.init_from` names, checked
    against this run's target (its weights' hash) and head shapes, before any work."""
    try:
        config = read_export_config(path)
    except SpecdecError as error:
        raise SpecdecError(f"head.init_from: {error}") from None
    check(config["kind"] == "hf_eagle3",
          f"head.init_from: {path} holds an export of kind {config['kind']}; the head starts from an hf_eagle3 "
          f"export (a head trained by task=hf_eagle3)")
    check(config["target"]["weights_sha256"] == weights_sha256,
          f"head.init_from: {path} holds a head for another target (weights sha256 "
          f"{config['target']['weights_sha256'][:16]}..., target.path's {weights_sha256[:16]}...)")
    theirs = Eagle3Config.from_dict(config["prophet"]).to_dict()
    ours = head.to_dict()
    differ = [f"{k} {theirs.get(k)!r} (this run: {ours.get(k)!r})"
              for k in sorted(ours) if theirs.get(k) != ours.get(k)]
    check(not differ, f"head.init_from: {path} holds a head of other shapes: {'; '.join(differ)}: set head.aux_layers "
                      f"and head.draft_vocab_size to the export's")
    weights = Path(path) / config["weights"]
    check(weights.is_file(), f"head.init_from: {weights} is missing: the export is incomplete")
    try:
        with safe_open(str(weights), framework="pt") as f:
            d2t = f.get_tensor("d2t")
    except Exception as error:  # noqa: BLE001  safetensors raises its own error types for a corrupt file
        raise SpecdecError(f"head.init_from: cannot read {weights} ({one_line(error)})") from None
    return config, (d2t.long() + torch.arange(d2t.numel())).tolist()


# ------------------------------------------------------------------------------ validate

def validate(cfg: DictConfig, options: Eagle3Options) -> dict[str, Any]:
    """Check the target, the head, the draft vocabulary and the data before any work; loads the
    target once (`hf_target.check_target`) to identify its weights."""
    sizes = from_dict(Eagle3Sizes, to_plain(cfg.get("head")), "head")

    def config(model: Any, draft_size: int, vocab: int) -> Eagle3Config:
        return Eagle3Config.for_target(model, draft_vocab_size=draft_size, aux_layers=sizes.aux_layers,
                                       vocab_size=vocab)

    kwargs = validate_head(cfg, sizes, config, options.ttt_steps + 1, f"task.ttt_steps ({options.ttt_steps})")
    return dict(kwargs, ttt_steps=options.ttt_steps, ttt_decay=float(options.ttt_decay),
                tv_weight=float(options.tv_weight), feature_weight=float(options.feature_weight),
                ttt_ramp=float(options.ttt_ramp), feature_noise=float(options.feature_noise))



def check_cache_layers(cfg: Any, head: Any, sha: str, seq_len: int) -> list[int]:
    """The layers the cache `data.cache` concatenates, checked to hold the head's aux layers (its
    taps) and the target's last (`head`: any config with `aux_layers` and `target_layers`)."""
    needed = sorted(set(head.aux_layers) | {head.target_layers})
    meta = check_cache(required(cfg, "data.cache", f"CACHE_DIR ({HOW_TO_BUILD})"), weights_sha256=sha,
                       seq_len=seq_len, model="target.path")
    layers = [int(i) for i in meta.get("layers", [head.target_layers])]
    missing = [i for i in needed if i not in layers]
    check(not missing, f"data.cache {cfg.data.cache} holds hidden states of layers {layers}; the head needs "
                       f"{needed} (aux layers {head.aux_layers} and the last, {head.target_layers}): rebuild it "
                       f"with specdec cache --layers {','.join(map(str, needed))}")
    return layers

def validate_head(cfg: DictConfig, sizes: Any, make_config: Any, positions: int, needs: str) -> dict[str, Any]:
    """What every EAGLE-3-family task checks before any work (the target, the draft vocabulary,
    a start export, the cache's layers), and the settings it gives its module but the task's own
    options. `sizes`: the `head:` node (aux_layers, draft_vocab_size, draft_vocab, train_lm_head,
    init_layer, init_from); `make_config(model, draft_size, vocab)` the head's config; rows need
    `positions` positions for what `needs` names."""
    layers = []                     # the one target layer a head trained from a cache reads: its start
    if sizes.init_layer and sizes.init_from is None:
        depth = int(text_config(load_config(required(cfg, "target.path", HOW_TO_GIVE), "target.path"))
                    .num_hidden_layers)
        aux = sizes.aux_layers if sizes.aux_layers is not None else default_aux_layers(depth)
        layers = [min(aux[-1], depth - 1)]                      # Eagle3Head.init_layer_from's
    target, path, tokenizer, model, sha, cached = check_target(cfg, layers)
    vocab = min(len(tokenizer), logits_width(model))
    draft_size = vocab if sizes.draft_vocab_size is None else sizes.draft_vocab_size
    check(draft_size <= vocab, f"head.draft_vocab_size ({draft_size}) exceeds the target's vocabulary ({vocab})")
    head = make_config(model, draft_size, vocab)
    draft_ids = None
    start = None
    if sizes.init_from is not None:
        start, start_ids = read_start_export(sizes.init_from, sha, head)
    if draft_size < vocab and start is not None and sizes.draft_vocab is None:
        draft_ids = start_ids                                   # the export's draft vocabulary
    elif draft_size < vocab:
        counts_file = sizes.draft_vocab
        check(counts_file is not None, f"head.draft_vocab is not set: a draft vocabulary of {draft_size} < {vocab} "
                                       f"tokens is chosen from token counts (specdec draft-vocab --out FILE)")
        draft_ids = choose_draft_vocab(read_token_counts(counts_file, tokenizer, vocab), draft_size).tolist()
        check(start is None or draft_ids == start_ids,
              f"head.draft_vocab={counts_file} chooses another draft vocabulary than the export head.init_from "
              f"names: leave head.draft_vocab unset to keep the export's")
    seq_len = cfg.data.seq_len
    limit = HFDecoder(model).cfg.max_seq_len
    check(seq_len <= limit, f"data.seq_len ({seq_len}) exceeds the target's {limit} positions")
    check(seq_len >= positions, f"data.seq_len ({seq_len}) is too short for {needs}")
    cache_layers = None
    if cached:
        cache_layers = check_cache_layers(cfg, head, sha, seq_len)
    metadata = {"target": str(path.resolve()), "target_weights_sha256": sha,
                "embeddings": "cached" if cached else "online", "draft_vocab_size": draft_size,
                "aux_layers": head.aux_layers}
    if start is not None:
        metadata["init_from"] = {"path": str(Path(sizes.init_from).resolve()),
                                 "weights_sha256": start["weights_sha256"]}
    return dict(target_path=str(path.resolve()), weights_sha256=sha, target_dtype=target.dtype, head=head.to_dict(),
                draft_ids=draft_ids, train_lm_head=sizes.train_lm_head,
                init_layer=sizes.init_layer and start is None,        # an export's weights replace any start
                init_from=None if start is None else str(Path(sizes.init_from).resolve()),
                cache_layers=cache_layers, target_shard=target.shard, metadata=metadata)


# ------------------------------------------------------------------------------ the module

def cached_layers(embeds: torch.Tensor, order: list[int], aux_layers: list[int],
                  last_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux (b, n, A*H), last (b, n, H)) from a cache batch's "embeds" (b, n, len(order)*H), which
    concatenates the hidden states of the layers `order` in that order."""
    parts = embeds.unflatten(-1, (len(order), -1))
    aux = torch.cat([parts[..., order.index(i), :] for i in aux_layers], -1)
    return aux, parts[..., order.index(last_layer), :]



def with_noise(aux: torch.Tensor, layers: int, scale: float) -> torch.Tensor:
    """aux (..., layers * H) plus Gaussian noise whose std is `scale` times each layer's RMS at
    each position (float32): EAGLE's augmentation of the target's features in training."""
    parts = aux.float().unflatten(-1, (layers, -1))
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()
    return (parts + scale * rms * torch.randn_like(parts)).flatten(-2)


@dataclass(frozen=True)
class HFEagle3Settings:
    """What `validate` gives HFEagle3Module, the hyper-parameters its checkpoints record.
    `target_path`, `weights_sha256`: the target's source and the hash its weights must have;
    `head`: an Eagle3Config dict; `draft_ids`: the draft vocabulary's target ids (None: the first
    draft_vocab_size, the whole vocabulary); `cache_layers`: the layers a cache's "embeds"
    concatenate, in order (None: hidden states online). The head trains in float32 whatever the
    target's `target_dtype`. `init_from`: an hf_eagle3 export (checked by `validate`) whose weights
    the head starts from; a resumed run then takes its checkpoint's. `target_shard`: split the
    target across the processes at fit start (target.shard). The ttt_* and *_weight fields:
    `Eagle3Options`'."""

    target_path: str
    weights_sha256: str
    head: dict[str, Any]
    target_dtype: str = "float32"
    draft_ids: list[int] | None = None
    train_lm_head: bool = True
    init_layer: bool = False
    init_from: str | None = None
    ttt_steps: int = 4
    ttt_decay: float = 0.8
    tv_weight: float = 0.0
    feature_weight: float = 0.0
    ttt_ramp: float = 0.0
    feature_noise: float = 0.0
    cache_layers: list[int] | None = None
    target_shard: bool = False


class HFEagle3Module(HFTargetHead, TaskModule):
    task = "hf_eagle3"
    settings_type: type = HFEagle3Settings
    config_type: type = Eagle3Config          # the head's config class (a subclass task's head has more fields)

    def __init__(self, optim: dict[str, Any] | None = None, seed: int = 0, metadata: dict[str, Any] | None = None,
                 compile: bool = False, **settings: Any) -> None:
        """`settings`: the fields of `HFEagle3Settings` (plain values: a checkpoint rebuilds the
        module without Hydra); the target is loaded here, the head built on it."""
        super().__init__(optim, seed, metadata, compile)
        s = read_settings(self.settings_type, type(self), settings)
        self.save_settings(s, optim, seed, metadata, compile)
        draft_ids, init_from = s.draft_ids, s.init_from
        cache_layers, target_shard, train_lm_head = s.cache_layers, s.target_shard, s.train_lm_head
        self._target = self._frozen_target(target_shard)
        self._parts = FrozenModel(self._load_parts) if cache_layers else self._target     # online: the whole one
        ids = None if draft_ids is None else torch.tensor(draft_ids, dtype=torch.long)
        target = self._parts.get(torch.device("cpu"))
        self.head = self.build_head(s, target, ids).float()
        if init_from is not None:                   # validate checked its target and shapes
            try:                                    # copied in full precision, names and shapes checked
                self.head.load_state_dict(read_export_tensors(init_from))
            except RuntimeError as error:
                raise SpecdecError(f"head.init_from: {init_from} does not fit the head: {one_line(error)}") from None
        self.head.lm_head.weight.requires_grad_(train_lm_head)
        if compile:
            self.head.layers.compile()
        self._tracked: dict[str, torch.Tensor] = {}

    def build_head(self, s: Any, target: Any, ids: torch.Tensor | None) -> Eagle3Head:
        """The head the settings `s` describe, on `target` (the module's target or its parts)."""
        return Eagle3Head(Eagle3Config.from_dict(s.head), target, ids, init_layer_from_target=s.init_layer)

    def trainable(self) -> nn.Module:
        return self.head

    def head_on(self, target: Any) -> nn.Module:
        copy = type(self.head)(self.head.config, target, self.head.draft_ids.cpu(), init_from_target=False)
        copy.to(self.head.fc.weight).load_state_dict(self.head.state_dict())
        return copy.train(self.head.training)

    def head_layers(self) -> list[int]:
        """The target layer `head.init_layer` starts the head's layer from (`Eagle3Head.init_layer_from`)."""
        if not self.hparams.init_layer:
            return []
        return [init_layer_index(self.config_type.from_dict(self.hparams.head))]

    # -- steps -----------------------------------------------------------------------------------

    def _inputs(self, batch: torch.Tensor | dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """(tokens (b, n + 1), aux (b, n, A*H), last (b, n, H), label mask (b, n) or None)."""
        layers = self.head.aux_layers
        last_layer = self.head.config.target_layers
        if isinstance(batch, dict) and "embeds" in batch:
            aux, last = cached_layers(batch["embeds"], self.hparams.cache_layers or [last_layer], layers, last_layer)
            return batch["tokens"], aux, last, label_mask(batch, batch["embeds"].shape[1])
        tokens = batch["tokens"] if isinstance(batch, dict) else batch     # online: data=hf_text or data=hf_chat
        with torch.no_grad():
            out = self.target(input_ids=tokens[:, :-1], output_hidden_states=True, use_cache=False, logits_to_keep=1)
        states = out.hidden_states
        mask = label_mask(batch, tokens.shape[1] - 1) if isinstance(batch, dict) else None
        return tokens, torch.cat([states[i] for i in layers], -1), states[last_layer], mask

    def _loss(self, batch, greedy: bool = False, steps: int | None = None):
        """(`Eagle3Head.ttt_loss` on the batch over `steps` unrolled steps (None: `unrolled()`), rows)."""
        _ = self.parts                                                # on the module's device
        tokens, aux, last, mask = self._inputs(batch)
        noise = self.hparams.get("feature_noise", 0.0)
        if noise and self.training:
            aux = with_noise(aux, len(self.head.aux_layers), noise)
        ok = self.head.greedy_in_vocab(last[:, 1:]) if greedy else None
        return self.head.ttt_loss(tokens, aux, last, mask, steps=self.unrolled() if steps is None else steps,
                                  decay=self.hparams.ttt_decay, tv_weight=self.hparams.get("tv_weight", 0.0),
                                  feature_weight=self.hparams.get("feature_weight", 0.0),
                                  greedy_in_vocab=ok), tokens.shape[0]

    def trained_steps(self) -> int:
        """Draft steps the training unrolls at this point of the run: one while it is within the
        first `ttt_ramp` of its budget (the larger of the steps' and the time's share, as the
        schedule reads it), else `ttt_steps`. Read in training and in validation alike."""
        ramp = self.hparams.get("ttt_ramp", 0.0)
        if not ramp or self._trainer is None:
            return self.hparams.ttt_steps
        progress = max(self.global_step / max(1, self.trainer.max_steps), self.time_fraction() or 0.0)
        return 1 if progress < ramp else self.hparams.ttt_steps

    def unrolled(self) -> int:
        """Draft steps unrolled now: `trained_steps()` in training; validation always unrolls
        `ttt_steps` (its per-step figures and the full-unroll loss need them all)."""
        return self.trained_steps() if self.training else self.hparams.ttt_steps

    def per_step(self, loss: torch.Tensor, steps: int) -> torch.Tensor:
        """A `ttt_loss` over `steps` unrolled steps (the sum of step k's mean loss times
        ttt_decay^k) as the weighted mean per step: divided by the sum of the weights. The figure
        `train/loss` and `val/loss` both log, over the steps trained now, so the two read alike
        during the ramp (one step) and after it (all), where the sums differ by the steps' count."""
        return loss / sum(self.hparams.ttt_decay ** k for k in range(steps))

    def training_step(self, batch: torch.Tensor | dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out, _ = self._loss(batch)
        acc = out.step_correct.float() / out.step_count.clamp(min=1).float()
        parts = {"kl/step0": out.step_kl[0], "accuracy/pos1": acc[0], f"accuracy/pos{len(acc)}": acc[-1]}
        self.log_train(self.per_step(out.loss.detach(), len(acc)), parts)
        return out.loss

    def evaluate(self, batch: torch.Tensor | dict[str, torch.Tensor], prefix: str) -> None:
        """`{prefix}/loss`: the loss per step over the steps the training unrolls now, as `train/loss`
        (during the ramp a second, one-step `ttt_loss`); `{prefix}/loss_all_steps`: over all
        `ttt_steps` (the checkpoint's monitor: it means the same before and after the ramp)."""
        out, b = self._loss(batch, greedy=True)
        steps = self.trained_steps()
        trained = out.loss if steps == len(out.step_kl) else self._loss(batch, steps=steps)[0].loss
        self.log(f"{prefix}/loss", self.per_step(trained, steps), prog_bar=True, sync_dist=True, batch_size=b)
        self.log(f"{prefix}/loss_all_steps", self.per_step(out.loss, len(out.step_kl)), sync_dist=True, batch_size=b)
        self.log(f"{prefix}/draft_vocab_mass", out.vocab_mass, sync_dist=True, batch_size=b)
        sums = torch.stack([out.step_kl * out.step_count, out.step_hits.float(), out.step_count.float()]).double()
        self._tracked[prefix] = self._tracked.get(prefix, 0) + sums

    def _log_tracked(self, prefix: str) -> None:
        """Per-step KL, accuracy given the earlier steps right, and simulated tokens per call over
        the epoch's rows, all ranks'."""
        if prefix not in self._tracked:
            return
        sums = self._tracked.pop(prefix)
        sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum") if self._trainer else sums
        kl_sum, hits, count = sums.cpu()
        chain = hits / count.clamp(min=1)                       # P(steps 0..k all right)
        for k in range(len(chain)):
            self.log(f"{prefix}/ttt_kl/step{k}", float(kl_sum[k] / count[k].clamp(min=1)))
            before = chain[k - 1] if k else torch.tensor(1.0, dtype=chain.dtype)
            self.log(f"{prefix}/ttt_accuracy/pos{k + 1}", float(chain[k] / before.clamp(min=1e-12)))
        self.log(f"{prefix}/simulated_tokens_per_call", float(1 + chain.sum()))

    def start_epoch(self, prefix: str) -> None:
        self._tracked.pop(prefix, None)

    def end_epoch(self, prefix: str) -> None:
        self._log_tracked(prefix)

    # -- decoding and export ---------------------------------------------------------------------

    def export_metadata(self) -> dict[str, Any]:
        return {"target_path": self.hparams.target_path, "target_weights_sha256": self.hparams.weights_sha256,
                "ttt_steps": self.hparams.ttt_steps, "train_lm_head": self.hparams.train_lm_head}


TASK = Task(name="hf_eagle3", config=Eagle3Options, module=HFEagle3Module,
            data=(HFTextDataModule, HFChatDataModule, HFEmbeddingsDataModule), validate=validate,
            can_shard_target=True)
