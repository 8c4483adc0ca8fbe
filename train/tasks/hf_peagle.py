"""task=hf_peagle: a P-EAGLE head trained against a frozen Hugging Face target.

`python -m train experiment=smollm2_peagle data.cache=DIR head.draft_vocab=COUNTS.json`, on the same
cache of the target's hidden states as task=hf_eagle3 (`data=hf_embeddings`: the aux layers and the
last), or online (`data=hf_text`, `data=hf_chat`). The head is
`specdec_models.heads.peagle.PEagleHead`: EAGLE-3's head (fc over the aux layers, one decoder layer,
an LM head over a draft vocabulary, the target's frozen embedding) that drafts
`head.parallel_depths` tokens in one pass, depths 1.. read a learned mask embedding and mask feature.

Training is P-EAGLE's (`PEagleHead.parallel_loss`; speculators' `peagle`): depth 0 teacher-forced at
every position, depth d at a random share max(task.down_sample_ratio^d, task.down_sample_ratio_min)
of the row's answer positions, nested in depth d - 1's (COD sampling); the loss is the forward KL
toward the target's distribution renormalised over the draft vocabulary, pooled over every sampled
pair. Only answer tokens count (`label_mask`, as for hf_eagle3), and no chain runs past a label
that does not count: none crosses the end of a row's conversation, a prompt or a user turn
(`heads.peagle.depth_chains`). Validation samples every chain (ratio 1) and logs, per depth d, under
hf_eagle3's names, the KL (`val/ttt_kl/step{d}`) and the accuracy given every depth before right
(`val/ttt_accuracy/pos{d+1}`: exact for greedy decoding, whose depths read no draft) and the
tokens per call they imply (`val/simulated_tokens_per_call`). `val/loss` is the pooled loss at ratio 1 (the checkpoint's
monitor). The draft vocabulary, `head.train_lm_head` and `head.layers_from_target` (1: the layer
starts as the target's, `Eagle3Head.init_layer_from`) are hf_eagle3's. The export is the head with
its target's identity (kind hf_peagle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from specdec_models.config import from_dict
from specdec_models.errors import check
from specdec_models.heads.peagle import PEagleConfig, PEagleHead

from ..data.chat_rows import HFChatDataModule
from ..data.hf_embeddings import HFEmbeddingsDataModule
from ..data.hf_text import HFTextDataModule
from .base import Task, to_plain
from .hf_eagle3 import HFEagle3Module, HFEagle3Settings, check_vocab_sizes, validate_head, with_noise
from .hf_target import check_head_kind


@dataclass(frozen=True)
class PEagleOptions:
    """The `task:` node of task=hf_peagle: the depth sampling (speculators' names and defaults)."""

    down_sample_ratio: float = 0.7        # depth d trains on max(ratio^d, ratio_min) of a row's answer positions
    down_sample_ratio_min: float = 0.2
    feature_noise: float = 0.0            # training noise on the aux hidden states, in units of each one's RMS

    def __post_init__(self) -> None:
        for name in ("down_sample_ratio", "down_sample_ratio_min"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1,
                  f"task.{name} must be in (0, 1], got {value!r}")
        value = self.feature_noise
        check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf"),
              f"task.feature_noise must be a number >= 0, got {value!r}")


@dataclass(frozen=True)
class PEagleSizes:
    """The `head:` node: its kind, aux layers (null: [2, L//2, L-3]), the draft vocabulary and its
    source, K, the mask token (null: the vocabulary's last id) and the layers started from the target's."""

    kind: str = "peagle"
    aux_layers: list[int] | None = None
    draft_vocab_size: int | None = 8192
    draft_vocab: str | None = None
    train_lm_head: bool = True
    parallel_depths: int = 4
    mask_token_id: int | None = None
    layers_from_target: int = 0

    def __post_init__(self) -> None:
        check_head_kind(self.kind, "peagle")
        check_vocab_sizes(self)

    @property
    def init_layer(self) -> bool:
        return self.layers_from_target > 0

    @property
    def init_from(self) -> None:
        return None


def validate(cfg: DictConfig, options: PEagleOptions) -> dict[str, Any]:
    """hf_eagle3's checks (`validate_head`) with P-EAGLE's config: K >= 2, the taps inside the
    target's layers and the mask token inside its vocabulary, each refused in one line."""
    sizes = from_dict(PEagleSizes, to_plain(cfg.get("head")), "head")

    def config(model: Any, draft_size: int, vocab: int) -> PEagleConfig:
        return PEagleConfig.for_target(model, draft_vocab_size=draft_size, aux_layers=sizes.aux_layers,
                                       vocab_size=vocab, parallel_depths=sizes.parallel_depths,
                                       mask_token_id=sizes.mask_token_id, layers_from_target=sizes.layers_from_target)

    kwargs = validate_head(cfg, sizes, config, sizes.parallel_depths + 1,
                           f"head.parallel_depths ({sizes.parallel_depths})")
    return dict(kwargs, down_sample_ratio=float(options.down_sample_ratio),
                down_sample_ratio_min=float(options.down_sample_ratio_min),
                feature_noise=float(options.feature_noise))


@dataclass(frozen=True)
class HFPEagleSettings(HFEagle3Settings):
    """`HFEagle3Settings` (its ttt_* fields unused) and the depth sampling of `PEagleOptions`."""

    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2


class HFPEagleModule(HFEagle3Module):
    task = "hf_peagle"
    settings_type: type = HFPEagleSettings
    config_type: type = PEagleConfig

    def build_head(self, s: Any, target: Any, ids: torch.Tensor | None) -> PEagleHead:
        return PEagleHead(PEagleConfig.from_dict(s.head), target, ids)

    def head_layers(self) -> list[int]:
        """The target layer `head.layers_from_target` starts the head's layer from."""
        return super().head_layers() if PEagleConfig.from_dict(self.hparams.head).layers_from_target else []

    def _loss(self, batch: Any, greedy: bool = False, steps: int | None = None, batch_idx: int = 0):
        """(`PEagleHead.parallel_loss` on the batch, rows): in training at the depth sampling's
        ratios with the step's generator, in validation every chain."""
        _ = self.parts                                                # on the module's device
        tokens, aux, last, mask = self._inputs(batch)
        noise = self.hparams.get("feature_noise", 0.0)
        if noise and self.training:
            aux = with_noise(aux, len(self.head.aux_layers), noise)
        ok = self.head.greedy_in_vocab(last[:, 1:]) if greedy else None
        if self.training:
            ratio, ratio_min = self.hparams.down_sample_ratio, self.hparams.down_sample_ratio_min
            g = self._generator(batch_idx)
        else:
            ratio, ratio_min, g = 1.0, 1.0, None
        return self.head.parallel_loss(tokens, aux, last, mask, ratio=ratio, ratio_min=ratio_min, generator=g,
                                       greedy_in_vocab=ok), tokens.shape[0]

    def _generator(self, batch_idx: int) -> torch.Generator | None:
        """The step's generator (a resumed run draws the same chains), on the CPU: `depth_chains`
        moves its draws to the batch's device."""
        if self._trainer is None:
            return None
        return self.generator(self.micro_batch(batch_idx), torch.device("cpu"))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out, _ = self._loss(batch, batch_idx=batch_idx)
        acc = out.depth_correct.float() / out.depth_count.clamp(min=1).float()
        parts = {"kl/depth0": out.depth_kl[0], "accuracy/pos1": acc[0], f"accuracy/pos{len(acc)}": acc[-1]}
        self.log_train(out.loss.detach(), parts)
        return out.loss

    def evaluate(self, batch: Any, prefix: str) -> None:
        """`{prefix}/loss` (every chain), `{prefix}/loss_all_steps` the same (the monitor hf_eagle3's
        experiments name), and the per-depth sums `_log_tracked` turns into KL, accuracy and tokens per call."""
        out, b = self._loss(batch, greedy=True)
        self.log(f"{prefix}/loss", out.loss, prog_bar=True, sync_dist=True, batch_size=b)
        self.log(f"{prefix}/loss_all_steps", out.loss, sync_dist=True, batch_size=b)
        sums = torch.stack([out.depth_kl * out.depth_count, out.depth_hits.float(), out.depth_count.float()]).double()
        self._tracked[prefix] = self._tracked.get(prefix, 0) + sums

    def trained_steps(self) -> int:
        return self.head.config.parallel_depths

    def export_metadata(self) -> dict[str, Any]:
        return {"target_path": self.hparams.target_path, "target_weights_sha256": self.hparams.weights_sha256,
                "parallel_depths": self.head.config.parallel_depths,
                "down_sample_ratio": self.hparams.down_sample_ratio,
                "down_sample_ratio_min": self.hparams.down_sample_ratio_min,
                "train_lm_head": self.hparams.train_lm_head}


TASK = Task(name="hf_peagle", config=PEagleOptions, module=HFPEagleModule,
            data=(HFTextDataModule, HFChatDataModule, HFEmbeddingsDataModule), validate=validate,
            can_shard_target=True)
