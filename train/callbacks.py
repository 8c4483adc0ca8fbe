"""The speculative-decoding evaluation callback: what a draft buys, measured while it trains.

At the end of every validation epoch (not the sanity check) `SpeculativeEval` decodes from K
fixed validation prompts with real speculative decoding (`specdec_models.decode.generate`,
Leviathan et al. 2022 / Chen et al. 2023) and with plain KV-cached decoding of the same target,
at each temperature. What it decodes with comes from the LightningModule's
`speculative_models()`: {"target": Decoder, "prophet": ModelWithProphet} (a prophet drafts) or
{"target": Decoder, "draft": Decoder} (a draft model drafts); a module with only a `net`
(ModelWithProphet) attribute is decoded as main model + prophet. It logs (names as in
docs/DECODING.md):

    val/acceptance_rate/t{T}                 accepted drafts / drafted tokens
    val/tokens_per_call/t{T}                 emitted tokens / target calls (bonus/correction included)
    val/alpha/t{T}                           mean sum_x min(p, q) over verified positions
    val/per_position_acceptance/pos{i}/t{T}  fraction accepted at draft position i = 1..gamma
    val/base_tokens_per_second/t{T}          plain decoding, new tokens / wall second
    val/spec_tokens_per_second/t{T}          speculative decoding, new tokens / wall second
    val/speedup/t{T}                         wall time of base / speculative decoding
    val/spec_eval_seconds                    wall time of the whole evaluation (not training time)

T is the temperature written with `{:g}`: t0 (greedy), t1, t0.7. The samples go to
`<samples_dir>/speculative_samples.jsonl` (one line per prompt, temperature and evaluation;
samples_dir defaults to the trainer's default_root_dir, the run's output directory), and, when a
`WandbLogger` is attached, to a W&B table `val/samples`.

Decoding runs in fp32 on the module's parameters (autocast off, also under bf16-mixed), in eval
mode under `torch.inference_mode`, with a generator seeded the same way at every evaluation so
samples compare across steps. Under DDP only global rank 0 decodes; the other ranks wait at a
barrier. Metrics are logged with `rank_zero_only=True` (not usable as a checkpoint monitor).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from torch import Tensor, nn

from specdec_models import ModelWithProphet, byte_tokenizer
from specdec_models.decode import generate
from specdec_models.errors import SpecdecError, check, check_positive_int
from specdec_models.hf import HFDecoder

from .data.streams import SpecdecDataModule
from .tasks.base import SpeculativeModels

SAMPLES_FILE = "speculative_samples.jsonl"
TABLE_KEY = "val/samples"


def temperature_tag(temperature: float) -> str:
    """The metric suffix of a temperature: 0 -> 't0', 1.0 -> 't1', 0.7 -> 't0.7'."""
    return f"t{float(temperature):g}"


def torch_modules(models: SpeculativeModels) -> list[nn.Module]:
    """The nn.Modules behind the models to decode with (a Hugging Face model behind its HFDecoder)."""
    found = [models.target, models.draft, models.prophet]
    return [m.model if isinstance(m, HFDecoder) else m for m in found if m is not None]


class SpeculativeEval(L.Callback):
    def __init__(self, num_prompts: int = 4, prompt_len: int = 64, max_new_tokens: int = 64, gamma: int = 5,
                 temperatures: Sequence[float] = (0.0, 1.0), seed: int = 0, samples_dir: str | None = None,
                 num_threads: int | None = None) -> None:
        """`num_prompts` fixed prompts of `prompt_len` bytes from `trainer.datamodule.prompts`,
        `max_new_tokens` new bytes each, `gamma` drafts per round, one decoding per temperature.
        `num_threads`: CPU threads while decoding (None: the process's setting). Decoding a few
        rows is a chain of small latency-bound ops: on a CPU shared with other work, one thread
        can be many times faster than two that wait for each other."""
        super().__init__()
        for name, value in [("num_prompts", num_prompts), ("prompt_len", prompt_len),
                            ("max_new_tokens", max_new_tokens), ("gamma", gamma)]:
            check_positive_int(value, f"speculative_eval.{name}")
        temperatures = [float(t) for t in temperatures]
        check(len(temperatures) > 0 and all(t >= 0 and math.isfinite(t) for t in temperatures),
              f"speculative_eval.temperatures must be a non-empty list of numbers >= 0, got {temperatures!r}")
        check(len({temperature_tag(t) for t in temperatures}) == len(temperatures),
              f"speculative_eval.temperatures has duplicates: {temperatures!r}")
        self.num_prompts, self.prompt_len, self.max_new_tokens = num_prompts, prompt_len, max_new_tokens
        self.gamma, self.temperatures, self.seed = gamma, temperatures, seed
        self.samples_dir = samples_dir
        check(num_threads is None or (isinstance(num_threads, int) and num_threads >= 1),
              f"speculative_eval.num_threads must be a positive integer or null, got {num_threads!r}")
        self.num_threads = num_threads
        self._prompts: Tensor | None = None
        self.last_metrics: dict[str, float] = {}
        self.text = byte_tokenizer.decode       # tokens -> text of the samples; the DataModule's decode_text if any

    # -- the evaluation itself (no trainer needed: scripts/bench_train.py times it alone) --------

    def check_model(self, models: ModelWithProphet | SpeculativeModels) -> SpeculativeModels:
        """The models to decode with, checked: a ModelWithProphet is its main model drafted by
        its prophet."""
        if isinstance(models, ModelWithProphet):
            models = SpeculativeModels(target=models.model, prophet=models)
        check(isinstance(models, SpeculativeModels),
              f"SpeculativeEval needs a ModelWithProphet or SpeculativeModels, got {type(models).__name__}")
        if models.prophet is not None:
            needed = self.gamma + 1
            check(models.prophet.prophet_cfg.prophet_train_length >= needed,
                  f"speculative_eval.gamma ({self.gamma}) needs prophet_train_length >= gamma + 1 = {needed}, "
                  f"got {models.prophet.prophet_cfg.prophet_train_length}")
        return models

    @torch.inference_mode()
    def evaluate(self, models: ModelWithProphet | SpeculativeModels,
                 prompts: Tensor) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Decode `prompts` (K, prompt_len) at each temperature, speculatively and plainly; return
        (metrics named as in the module docstring, one sample record per prompt and temperature).
        Runs in eval mode and fp32 (autocast off) and restores the modules' training flags."""
        models = self.check_model(models)
        device = models.target.device
        prompts = prompts.to(device)
        modes = {m: m.training for model in torch_modules(models) for m in model.modules()}
        for model in torch_modules(models):
            model.eval()
        threads = torch.get_num_threads()
        if self.num_threads is not None and device.type == "cpu":
            torch.set_num_threads(self.num_threads)
        autocast_off = torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        samples: list[dict[str, Any]] = []
        try:
            with autocast_off:
                for temperature in self.temperatures:
                    m, s = self._evaluate_at(models, prompts, temperature, device)
                    metrics.update(m)
                    samples.extend(s)
        finally:
            torch.set_num_threads(threads)
            for module, training in modes.items():
                module.training = training
        metrics["val/spec_eval_seconds"] = time.perf_counter() - t0
        return metrics, samples

    def _generator(self, device: torch.device, temperature: float) -> torch.Generator:
        # the same stream at every evaluation, a different one per temperature
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + int(round(temperature * 1000)))

    def _evaluate_at(self, models: SpeculativeModels, prompts: Tensor, temperature: float,
                     device: torch.device) -> tuple[dict[str, float], list[dict[str, Any]]]:
        tag = temperature_tag(temperature)
        target, drafter = models.target, models.drafter()
        decode = dict(max_new_tokens=self.max_new_tokens, gamma=self.gamma, temperature=temperature)
        # warm-up (a few tokens, same batch): first calls at a shape pay one-time costs that would
        # skew the timing
        warm = dict(decode, max_new_tokens=min(self.max_new_tokens, 2 * self.gamma + 2))
        generate(target, prompts, **drafter, generator=self._generator(device, temperature), **warm)
        generate(target, prompts, generator=self._generator(device, temperature), **warm)

        spec_tokens, spec = generate(target, prompts, **drafter, generator=self._generator(device, temperature),
                                     **decode)
        base_tokens, base = generate(target, prompts, generator=self._generator(device, temperature), **decode)
        spec, base = spec.to_dict(), base.to_dict()
        metrics = {
            f"val/acceptance_rate/{tag}": spec["acceptance_rate"],
            f"val/tokens_per_call/{tag}": spec["tokens_per_call"],
            f"val/alpha/{tag}": spec["alpha"],
            f"val/base_tokens_per_second/{tag}": base["tokens_per_second"],
            f"val/spec_tokens_per_second/{tag}": spec["tokens_per_second"],
            # both emit exactly max_new_tokens per row (no EOS), so this is base / spec wall time
            f"val/speedup/{tag}": spec["tokens_per_second"] / max(base["tokens_per_second"], 1e-12),
        }
        for i, rate in enumerate(spec["per_position_acceptance"], start=1):
            metrics[f"val/per_position_acceptance/pos{i}/{tag}"] = rate
        metrics = {k: float("nan") if v is None else float(v) for k, v in metrics.items()}
        samples = []
        for row, (prompt, new, plain) in enumerate(zip(prompts, spec_tokens, base_tokens)):
            samples.append({
                "temperature": temperature,
                "prompt_index": row,
                "prompt": self.text(prompt),
                "continuation": self.text(new),
                "base_continuation": self.text(plain),
                # greedy speculative decoding is exact: in fp32 it must equal plain greedy decoding
                "matches_base": bool(torch.equal(new, plain)),
                "acceptance_rate": metrics[f"val/acceptance_rate/{tag}"],
                "tokens_per_call": metrics[f"val/tokens_per_call/{tag}"],
                "speedup": metrics[f"val/speedup/{tag}"],
            })
        return metrics, samples

    # -- Lightning hooks -------------------------------------------------------------------------

    def prompts(self, trainer: L.Trainer) -> Tensor:
        """The K fixed validation prompts (fetched once from the DataModule)."""
        if self._prompts is None:
            datamodule = trainer.datamodule
            if not isinstance(datamodule, SpecdecDataModule):
                raise SpecdecError("SpeculativeEval needs a SpecdecDataModule (train.data.streams) to draw prompts "
                                   "from: pass it as trainer.fit(module, datamodule=...)")
            self._prompts = datamodule.prompts(self.num_prompts, self.prompt_len).long().cpu()
            self.text = datamodule.decode_text
        return self._prompts

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if trainer.is_global_zero:
            metrics, samples = self.evaluate(pl_module.speculative_models(), self.prompts(trainer))
            self.last_metrics = metrics
            for name, value in metrics.items():
                pl_module.log(name, value, rank_zero_only=True)
            self._write_samples(trainer, samples)
        trainer.strategy.barrier("speculative_eval")

    def _write_samples(self, trainer: L.Trainer, samples: list[dict[str, Any]]) -> None:
        step = trainer.global_step
        rows = [{"step": step, **s} for s in samples]
        directory = Path(self.samples_dir or trainer.default_root_dir)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / SAMPLES_FILE, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns = list(rows[0])
                logger.log_table(key=TABLE_KEY, columns=columns, data=[[r[c] for c in columns] for r in rows],
                                 step=step)
