"""Train vLLM's `speculators` (0.9.0) EAGLE-3 trainer on this CPU, patched at run time only.

    python scripts/peers/run_speculators.py --data DIR --verifier DIR --out DIR --aux-layers 2,15,27 \
        --mask-token-id ID [--draft-vocab-size D --d2t FILE --t2d FILE] [--minutes M] [--max-steps N] \
        [--threads 1] [--ttt-steps 3] [-- EXTRA speculators train flags]

`speculators train` itself (`speculators.train.cli.main` on its `TrainConfig`) runs as one process
on the data `train.data.peer_formats.to_speculators` wrote, with `--draft-attn-impl sdpa
--loss-implementation eager --hidden-states-dtype float32 --num-workers 0` (flex attention, the
fused loss and bf16 autocast are for GPUs; dataloader workers would spawn processes) and the head
specdec computes: one full-attention Llama layer, every norm flag off (`--no-norm-before-residual
--no-norm-before-fc --no-norm-output`; specdec's loader refuses the other settings). Everything
else is speculators' default (Muon + AdamW, lr 1e-3, linear schedule, 90/10 train/validation).

Patches, none of them a file edit:
- `torch.accelerator.synchronize` is a no-op (the trainer's step timer calls it; there is no
  accelerator);
- `speculators.train.trainer.get_local_rank` returns "cpu" (the device the trainer moves the
  model and each batch to);
- the budget: after each optimizer step (`Trainer._schedulers_step`) a spent `Budget` raises
  speculators' own `TrainingInterruptedError`, on which the trainer saves its "interrupted"
  checkpoint, as on Ctrl+C; the train loader is wrapped to count the tokens each step trains on.

The head (`config.json`, `model.safetensors` of the last checkpoint) is copied to OUT/head, in
the speculators layout `load_eagle3` reads; OUT/report.json holds the throughput.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from runner import Budget, add_budget_args, parse_budget_args, write_report


class _Counting:
    """The train loader, counting the tokens (`document_ids` != -1) and answer tokens of each batch."""

    def __init__(self, loader, budget: Budget) -> None:
        self._loader, self._budget = loader, budget

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def __iter__(self):
        for batch in self._loader:
            self._budget.tokens += int((batch["document_ids"] != -1).sum())
            self._budget.answer_tokens += int(batch["loss_mask"].sum())
            yield batch


def patch(budget: Budget) -> None:
    """The runtime patches (module docstring)."""
    from speculators.train import trainer
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    torch.accelerator.synchronize = lambda *args, **kwargs: None
    trainer.get_local_rank = lambda: "cpu"
    Trainer = trainer.Trainer
    init, train_epoch, schedulers_step = Trainer.__init__, Trainer.train_epoch, Trainer._schedulers_step

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.train_loader = _Counting(self.train_loader, budget)

    def timed_epoch(self, *args, **kwargs):
        budget.start()
        t0 = time.perf_counter()
        try:
            return train_epoch(self, *args, **kwargs)
        finally:
            budget.seconds += time.perf_counter() - t0

    def step_then_check(self):
        schedulers_step(self)
        budget.steps += 1
        if budget.spent():
            raise TrainingInterruptedError(f"specdec budget: {budget.reason}")

    Trainer.__init__, Trainer.train_epoch, Trainer._schedulers_step = __init__, timed_epoch, step_then_check


def train_args(a: argparse.Namespace) -> list[str]:
    """The `speculators train` command line of a run (module docstring)."""
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(a.verifier), "--data-path", str(a.data),
            "--save-path", str(a.out / "checkpoints"), "--log-dir", str(a.out / "logs"),
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
            "--mask-token-id", str(a.mask_token_id), "--ttt-steps", str(a.ttt_steps),
            "--target-layer-ids", *map(str, a.aux_layers), "--num-layers", "1", "--full-attention-indices", "0",
            "--no-norm-before-residual", "--no-norm-before-fc", "--no-norm-output",
            "--num-workers", "0", "--total-seq-len", str(a.total_seq_len), "--epochs", str(a.epochs),
            "--seed", str(a.seed), "--no-resume-from-checkpoint"]
    if a.draft_vocab_size is not None:
        argv += ["--draft-vocab-size", str(a.draft_vocab_size), "--d2t-path", str(a.d2t), "--t2d-path", str(a.t2d)]
    return argv + list(a.extra)


def last_checkpoint(checkpoints: Path) -> Path:
    """The checkpoint the run ended with: "interrupted" (the budget), else its last epoch."""
    if (checkpoints / "interrupted" / "model.safetensors").is_file():
        return checkpoints / "interrupted"
    epochs = sorted((int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()), reverse=True)
    if not epochs:
        raise SystemExit(f"speculators saved no checkpoint in {checkpoints}")
    return checkpoints / str(epochs[0])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--verifier", type=Path, required=True, help="the target as a Hugging Face model directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--aux-layers", type=int, nargs=3, required=True, help="hidden_states indices")
    p.add_argument("--mask-token-id", type=int, required=True)
    p.add_argument("--draft-vocab-size", type=int)
    p.add_argument("--d2t", type=Path)
    p.add_argument("--t2d", type=Path)
    p.add_argument("--total-seq-len", type=int, default=2048, help="tokens packed per step")
    add_budget_args(p, seed=0)                             # extra: more `speculators train` flags
    return parse_budget_args(p, argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    budget = Budget(a.minutes, a.max_steps)
    patch(budget)
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    a.out.mkdir(parents=True, exist_ok=True)
    argv = train_args(a)
    speculators_train(TrainConfig.resolve(argv))
    checkpoint = last_checkpoint(a.out / "checkpoints")
    head = a.out / "head"
    shutil.rmtree(head, ignore_errors=True)
    head.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(checkpoint / name, head / name)
    write_report(a.out / "report.json", budget.report("speculators", a.threads, head=str(head),
                                                       checkpoint=str(checkpoint),
                                                       command=["speculators", "train", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
