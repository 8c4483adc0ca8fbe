"""Train SpecForge's (0.2.0) offline EAGLE-3 trainer on this CPU, patched at run time only.

    python scripts/peers/run_specforge.py --data DIR --verifier DIR --out DIR --aux-layers 2,15,27 \
        [--draft-vocab-size D --vocab-mapping FILE] [--minutes M] [--max-steps N] [--threads 1] \
        [--ttt-steps 3] [--lr 1e-4] [--max-length 2048] [-- EXTRA section.field=value overrides]

`specforge train` itself (`specforge.cli.main`, its typed run config) runs in this process on the
`.ckpt` files `train.data.peer_formats.to_specforge` wrote (`data.hidden_states_path`, offline
mode), with `training.attention_backend: sdpa` (flex attention and flash-attn are for GPUs),
`training.ttt_length` = our TTT steps, `model.torch_dtype: float32`, no dataloader workers, and an
explicit `model.draft_model_config` (`draft_config`): SpecForge's `LlamaForCausalLMEagle3` at the
target's shapes, one layer, the draft vocabulary and aux layers of specdec's head (the aux ids in
SGLang's numbering, as SpecForge's exporter writes them). The draft vocabulary is specdec's
(`model.vocab_mapping_path`: the {"d2t", "t2d"} file `peer_formats.vocab_files` wrote), not the one
SpecForge would count from the features. The learning-rate schedule is `constant` (no warmup):
a run stopped by a wall-time budget has no known length to decay over. Everything else is
SpecForge's default (AdamW, lr 1e-4, grad-norm clip 0.5, batch 1, seed 42).

Patches, none of them a file edit:
- `specforge.core.loss`, a Triton module (`import triton` at its top; a CPU install has none), is
  replaced in `sys.modules` before SpecForge imports it by `specforge_loss` (beside this file), the same
  maths in torch;
- `SPECFORGE_DEVICE=cpu` (SpecForge then takes the gloo backend and a CPU device mesh; its CLI
  starts the one-process group itself, world size 1) and `TORCHDYNAMO_DISABLE=1`, which makes its
  `torch.compile` decorators no-ops (inductor would compile C++ for each shape on this CPU);
- the budget: `TrainerCore.train_step` is wrapped to count each step's tokens (the positions of
  its rows) and answer tokens (`loss_mask`), and after the optimizer step that spends the budget
  it lowers the controller's `max_steps` to the current step, so SpecForge's own loop returns
  there and `Trainer.fit` saves its final checkpoint.

The target folder SpecForge reads its embedding and LM head from (`TargetHead`, which requires a
`*.index.json`) is OUT/target: links to the verifier's files and a `model.safetensors.index.json`
naming each tensor of `model.safetensors`, `lm_head.weight` included (SmolLM2 ties it to the
embedding; `specdec peers` writes the tied tensor under both names). The final checkpoint
is exported with SpecForge's own `export_to_sglang` to OUT/head, the SGLang layout
(`LlamaForCausalLMEagle3`, `midlayer.*`) `specdec_models.export.eagle3.load_eagle3` reads;
OUT/report.json holds the throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from runner import Budget, add_budget_args, parse_budget_args, write_report

LOSS_MODULE = "specforge.core.loss"


def patch_environment() -> None:
    """The patches that must precede SpecForge's imports (module docstring)."""
    import specforge_loss

    os.environ["SPECFORGE_DEVICE"] = "cpu"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    sys.modules[LOSS_MODULE] = specforge_loss


def patch_budget(budget: Budget) -> None:
    """Count each step's tokens; stop SpecForge's loop after the step that spends `budget`."""
    from specforge.training import controller

    Controller = next(cls for cls in vars(controller).values()
                      if isinstance(cls, type) and "_fit" in vars(cls) and "save_checkpoint" in vars(cls))
    running: list = []
    fit, train_step = Controller._fit, controller.TrainerCore.train_step

    def tracked_fit(self, *args, **kwargs):
        running.append(self)
        try:
            return fit(self, *args, **kwargs)
        finally:
            running.pop()

    def counted_step(self, batch, *args, **kwargs):
        budget.start()
        t0 = time.perf_counter()
        result = train_step(self, batch, *args, **kwargs)
        budget.seconds += time.perf_counter() - t0
        budget.tokens += int(batch.tensors["attention_mask"].sum())
        budget.answer_tokens += int(batch.tensors["loss_mask"].sum())
        if result.optimizer_stepped:
            budget.steps += 1
            if budget.spent() and running:
                loop = running[-1]
                loop.max_steps = loop.global_step + 1        # its loop returns after counting this step
        return result

    Controller._fit, controller.TrainerCore.train_step = tracked_fit, counted_step


def target_dir(verifier: Path, out: Path) -> Path:
    """OUT/target: the verifier's files (links) and the `*.index.json` SpecForge's TargetHead needs."""
    from safetensors import safe_open

    weights = verifier / "model.safetensors"
    if not weights.is_file():
        raise SystemExit(f"{weights} is missing: the verifier folder must hold one model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    for path in verifier.iterdir():
        link = out / path.name
        if not link.exists() and not path.name.endswith(".index.json"):
            link.symlink_to(path.resolve())
    with safe_open(str(weights), "pt") as f:
        names = list(f.keys())
    if "lm_head.weight" not in names:
        raise SystemExit(f"{weights} holds no lm_head.weight (a tied LM head must be written under that name too)")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}, indent=1) + "\n")
    return out


def draft_config(verifier: Path, aux_layers: list[int], draft_vocab_size: int | None, out: Path) -> Path:
    """SpecForge's draft config: a one-layer Llama `LlamaForCausalLMEagle3` at the target's shapes,
    the draft vocabulary, the aux layers in SGLang's numbering (`hidden_states` index - 1)."""
    from specdec_models.export.eagle3 import sglang_layer_ids

    t = json.loads((verifier / "config.json").read_text())
    t = t.get("text_config", t)
    rope = dict(t.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
    heads = int(t["num_attention_heads"])
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": t["hidden_size"], "target_hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"], "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads") or heads,
        "head_dim": t.get("head_dim") or t["hidden_size"] // heads, "hidden_act": t.get("hidden_act", "silu"),
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": t.get("max_position_embeddings", 2048), "attention_bias": False,
        "mlp_bias": False, "vocab_size": t["vocab_size"],
        "draft_vocab_size": draft_vocab_size or t["vocab_size"], "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(aux_layers, t["num_hidden_layers"]),
                         "use_aux_hidden_state": True},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config, indent=2) + "\n")
    return out


def run_config(a: argparse.Namespace, target: Path, draft: Path) -> dict:
    """SpecForge's typed run config (module docstring)."""
    return {
        "run_id": "specdec-peer", "output_dir": str(a.out / "run"),
        "model": {"target_model_path": str(target), "draft_model_config": str(draft), "torch_dtype": "float32",
                  "vocab_mapping_path": str(a.vocab_mapping or ""),
                  "aux_hidden_state_layer_ids": [i - 1 for i in a.aux_layers]},
        "data": {"hidden_states_path": str(a.data), "max_length": a.max_length, "dataloader_num_workers": 0},
        "training": {"attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "ttt_length": a.ttt_steps,
                     "num_epochs": a.epochs,
                     "learning_rate": a.lr, "lr_scheduler": "constant", "warmup_ratio": 0.0, "seed": a.seed,
                     "log_interval": 1, "save_interval": 0},
    }


def last_checkpoint(run: Path) -> Path:
    """The directory of the run's last saved checkpoint (the one holding its training state)."""
    states = sorted((p for p in run.rglob("*") if p.is_file() and p.suffix in (".pt", ".bin", ".safetensors")),
                    key=lambda p: p.stat().st_mtime)
    if not states:
        raise SystemExit(f"SpecForge saved no checkpoint in {run}")
    return states[-1].parent


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="the .ckpt files (peer_formats.to_specforge)")
    p.add_argument("--verifier", type=Path, required=True, help="the target as a Hugging Face model directory")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--aux-layers", type=int, nargs=3, required=True, help="hidden_states indices")
    p.add_argument("--draft-vocab-size", type=int)
    p.add_argument("--vocab-mapping", type=Path, help='{"d2t", "t2d"} of the draft vocabulary')
    p.add_argument("--lr", type=float, default=1e-4, help="SpecForge's default")
    p.add_argument("--max-length", type=int, default=2048)
    add_budget_args(p, seed=42)                            # extra: more section.field=value overrides
    a = parse_budget_args(p, argv)
    if (a.draft_vocab_size is None) != (a.vocab_mapping is None):
        p.error("--draft-vocab-size and --vocab-mapping go together")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    torch.set_num_threads(a.threads)
    patch_environment()
    budget = Budget(a.minutes, a.max_steps)
    patch_budget(budget)
    from specforge.cli import main as specforge_main
    from specforge.export.to_sglang import export_to_sglang

    a.out.mkdir(parents=True, exist_ok=True)
    target = target_dir(a.verifier, a.out / "target")
    draft = draft_config(a.verifier, a.aux_layers, a.draft_vocab_size, a.out / "draft_config.json")
    config = a.out / "specforge.json"
    config.write_text(json.dumps(run_config(a, target, draft), indent=2) + "\n")
    argv = ["train", "--config", str(config), *a.extra]
    status = specforge_main(argv)
    if status:
        raise SystemExit(f"specforge train exited with status {status}")
    checkpoint = last_checkpoint(a.out / "run")
    head = a.out / "head"
    export_to_sglang(str(checkpoint), str(draft), str(head),
                     vocab_mapping_path=None if a.vocab_mapping is None else str(a.vocab_mapping))
    write_report(a.out / "report.json", budget.report("specforge", a.threads, head=str(head),
                                                       checkpoint=str(checkpoint),
                                                       command=["specforge", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
