"""`target.shard`: the frozen target of an online head run split across the run's processes.

Online training (`data=hf_text`, `data=hf_chat`) of task=hf_eagle3 and task=hf_prophet runs the
frozen Hugging Face target under no_grad at every step, so each process of a data-parallel run
(`trainer=ddp`) holds the whole target: a target larger than one device cannot train a head. With
`target.shard: true` each of the run's N processes keeps 1/N of every decoder layer's weights
(torch's FSDP2 `fully_shard`, applied to each decoder layer and to the root, on the default process
group, `reshard_after_forward=True`): a layer's full weights are all-gathered just before it runs
and freed after it. Memory per process: about 1/N of the decoder layers, one layer's full weights
while it runs, and the token embedding, final norm and LM head whole, which every process keeps
(the root's ignored parameters) because the head reads them outside the target's forward at every
step (the shared embedding, the target's logits at the label). Cost: one all-gather per layer per
forward, a layer's weights in each. The head itself trains data-parallel (DDP) as it does without
sharding: the target is held outside the LightningModule (`train.tasks.base.FrozenModel`), where
Lightning's strategy never sees it.

When. Validation, building the head and the callbacks' checks see the whole target on the CPU;
`ShardedFrozenModel.shard` splits it in the module's `on_fit_start`, which every process runs
after Lightning has set up the process group and moved the module to its device.

Collectives. Each all-gather is collective: every process must run the target's forward the same
number of times. Training runs one forward per step in every process; validation runs one per
batch, and Lightning's distributed sampler gives every process the same number of validation
batches (it repeats rows to even them out). The evaluation callback decodes on rank 0 alone, which
a split target cannot do: `check_shard` refuses it in one line (`callbacks.speculative_eval=null`;
validation still logs the simulated tokens per call). The export after training rebuilds the
module on rank 0, which reloads the whole target on the CPU to record its identity: no forward.

FSDP2 runs on CPU processes with gloo (torch 2.13): `trainer=ddp trainer.accelerator=cpu` splits
the target as GPUs with NCCL do (tests/test_distributed.py runs two).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from specdec_models.errors import check

from .base import FrozenModel

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ checks before any work

def shard_requested(cfg: DictConfig) -> Any:
    """The value of `target.shard` (None when the config has no such key)."""
    node = cfg.get("target")
    return node.get("shard") if isinstance(node, DictConfig) else None


def check_task_can_shard(cfg: DictConfig, task: Any) -> None:
    """`target.shard` on a task that runs no frozen target (`Task.can_shard_target`): one line."""
    if shard_requested(cfg) in (None, False):
        return
    from . import tasks as all_tasks

    able = " or ".join(f"task={t.name}" for t in all_tasks().values() if t.can_shard_target)
    check(task.can_shard_target, f"target.shard: task={task.name} runs no frozen target to shard (only {able} "
                                 f"with data=hf_text or data=hf_chat do): drop target.shard")


def _processes(trainer: Any) -> int | None:
    """trainer.devices * trainer.num_nodes when the config fixes it (None for "auto" or -1)."""
    devices = trainer.get("devices") if isinstance(trainer, DictConfig) else None
    nodes = trainer.get("num_nodes", 1) if isinstance(trainer, DictConfig) else 1
    if isinstance(devices, str):
        devices = devices.strip()
        devices = int(devices) if devices.isdigit() else len(devices.strip(",").split(",")) if "," in devices else None
    elif OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1 or not isinstance(nodes, int):
        return None
    return devices * nodes


def check_shard(cfg: DictConfig, shard: bool, cached: bool) -> None:
    """What `target.shard: true` needs, each refused in one line before the target loads: the
    target runs (online data), more than one process, data-parallel training of the head (DDP),
    and no evaluation callback (it decodes on rank 0 alone)."""
    if not shard:
        return
    check(not cached, "target.shard: data=hf_embeddings reads the target's hidden states from a cache and never "
                      "runs the target: drop target.shard (it splits the target of online data, data=hf_text or "
                      "data=hf_chat)")
    trainer = cfg.get("trainer")
    processes = _processes(trainer)
    check(processes is None or processes > 1,
          "target.shard splits the target across the run's processes and this run has one (trainer.devices * "
          "trainer.num_nodes = 1): drop target.shard, or run trainer=ddp trainer.devices=N (N > 1)")
    strategy = trainer.get("strategy", "auto") if isinstance(trainer, DictConfig) else "auto"
    check(not isinstance(strategy, str) or strategy == "auto" or strategy.startswith("ddp"),
          f"target.shard splits the target beside data-parallel training of the head: trainer.strategy must be ddp "
          f"(trainer=ddp), got {strategy}")
    check(OmegaConf.select(cfg, "callbacks.speculative_eval", default=None) is None,
          "target.shard: callbacks.speculative_eval decodes on rank 0 alone, which a target split across the "
          "processes cannot do: set callbacks.speculative_eval=null (validation still logs the simulated tokens "
          "per call)")


# ------------------------------------------------------------------------------ the split

def decoder_layers(model: Any) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (`base_model.layers`, GPT-2's `h`)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    layers = layers if isinstance(layers, nn.ModuleList) else getattr(base, "h", None)
    check(isinstance(layers, nn.ModuleList) and len(layers) > 0,
          f"target.shard: {type(model).__name__} has no list of decoder layers (base_model.layers) to split: "
          f"drop target.shard")
    return layers


def held_elements(model: nn.Module) -> tuple[int, int]:
    """(parameter elements this process holds, elements of the whole model): a split parameter
    (a DTensor) counts its local shard."""
    from torch.distributed.tensor import DTensor

    held = whole = 0
    for p in model.parameters():
        whole += p.numel()                           # a DTensor's numel is the whole tensor's
        held += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return held, whole


def shard_target(model: nn.Module, device: torch.device) -> None:
    """Split `model`'s decoder layers across the default process group's ranks on `device` (FSDP2
    `fully_shard` per layer, then at the root with the rest ignored, `reshard_after_forward=True`);
    the rest (embedding, final norm, LM head, rotary buffers) moves to `device` whole. In place:
    the same object runs its forward as before, its layers' parameters now DTensor shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    inside = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in inside:
            t.data = t.data.to(device)               # whole on every process; tied tensors move once
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in layers:                             # fully_shard moves each layer to the device, then splits it
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    outside = {p for p in model.parameters() if id(p) not in inside}
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=outside)


class ShardedFrozenModel(FrozenModel):
    """A `FrozenModel` (the frozen target) that `shard(device)` splits across the processes (module
    docstring); until then, and in a process alone, a `FrozenModel`. `forget` drops the process's
    cache of the loaded target, which now holds the split model: a module built later (the export
    on rank 0) loads it whole again."""

    def __init__(self, load: Callable[[], nn.Module], forget: Callable[[], Any] = lambda: None) -> None:
        super().__init__(load)
        self._forget = forget
        self.sharded = False

    def shard(self, device: torch.device) -> None:
        """Split the target across the default process group's ranks, its layers on `device`. Every
        rank must call it (the module's on_fit_start); once only."""
        import torch.distributed as dist

        if self.sharded:
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            warnings.warn("target.shard: this run has one process: the target stays whole", stacklevel=2)
            return
        model = super().get(torch.device("cpu"))     # loaded (once), frozen, in eval mode
        shard_target(model, device)
        self._forget()
        self.sharded = True
        held, whole = held_elements(model)
        layers_held, layers_whole = held_elements(decoder_layers(model))
        log.info(f"target.shard: rank {dist.get_rank()} of {dist.get_world_size()} holds {held:,} of the target's "
                 f"{whole:,} parameter elements; of its decoder layers {layers_held:,} of {layers_whole:,}")

    def get(self, device: torch.device) -> nn.Module:
        if self.sharded:
            return self._model                       # its parts already live on the run's device
        return super().get(device)
