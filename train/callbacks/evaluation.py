"""The speculative-decoding evaluation callback: what a draft buys, measured while it trains.

At the end of every validation epoch (not the sanity check; with `every=N`, of every N-th and of
the one that ends training) `SpeculativeEval` decodes from K fixed validation prompts with real
speculative decoding (`specdec_models.decode.generate`, Leviathan et al. 2022 / Chen et al. 2023)
and with plain KV-cached decoding of the same target, at each temperature. What it decodes with
comes from the LightningModule's `speculative_models()`: {"target": Decoder, "prophet":
ModelWithProphet} (a prophet drafts), {"target": Decoder, "draft": Decoder} (a draft model
drafts), or a Hugging Face target with its draft or its prophet head
(`specdec_models.heads.HFProphet`). It logs (names as in docs/DECODING.md):

    val/acceptance_rate/t{T}                 accepted drafts / drafted tokens
    val/tokens_per_call/t{T}                 emitted tokens / target calls (bonus/correction included)
    val/alpha/t{T}                           mean sum_x min(p, q) over verified positions
    val/per_position_acceptance/pos{i}/t{T}  fraction accepted at draft position i = 1..gamma
    val/base_tokens_per_second/t{T}          plain decoding, new tokens / wall second
    val/spec_tokens_per_second/t{T}          speculative decoding, new tokens / wall second
    val/speedup/t{T}                         wall time of base / speculative decoding
    val/predicted_speedup/t{T}               E / (gamma c + v) from this run's own per-position
                                             acceptance and timed model calls (compare with speedup)
    val/best_gamma/b{B}/t{T}                 the gamma in 1..gamma with the best predicted speed-up,
                                             0 where none beats plain decoding (as gamma="auto" decides)
    val/best_predicted_speedup/b{B}/t{T}     at batch B = 1 and B = num_prompts (1 at gamma 0)
    val/spec_eval_seconds                    wall time of the whole evaluation (not training time)

With `tree="depth,topk,width[,lookup[..max]][,min_prob][,keep=p][,nodes=n]"` (an EAGLE-3 head), the
same prompts are also decoded with that draft tree (`specdec_models.decode.tree`, rows one after
another) and plainly one row at a time:

    val/tree/tokens_per_call/t{T}                     emitted tokens / target calls
    val/tree/per_position_acceptance/pos{i}/t{T}      fraction of rounds that accepted >= i tokens
    val/tree/speedup/t{T}                             wall time of plain / tree decoding, row by row

T is the temperature written with `{:g}`: t0 (greedy), t1, t0.7. With `choose_gamma` (the
default) the cost ratios c and v(1..gamma) are timed once per evaluation on the models' KV caches
(`decode.cost.measure_costs`, at batch 1 and num_prompts; v(gamma) at num_prompts from the run
itself) and combined with each temperature's per-position acceptance into `SpeedProfile`s (M18 of
docs/DECODING.md); the last evaluation's profiles are kept in the callback's checkpoint state and
the callback offers them as its `export_metadata()` (metadata `speed_profiles`), which
`train.checkpoints.export_checkpoint` writes into the export, where `--gamma auto` of the decoding
CLI reads them. Beside them the prophet tasks
log what other trainers report instead, from teacher-forced validation windows
(`ProphetTaskModule.track_drafted`): `val/teacher_forced_accuracy/pos{i}` and
`val/simulated_tokens_per_call` (compare it with `val/tokens_per_call/t0`). The samples go to
`<samples_dir>/speculative_samples.jsonl` (one line per prompt, temperature and evaluation;
samples_dir defaults to the trainer's default_root_dir, the run's output directory; rewritten
atomically at each evaluation, without the lines of this step or later ones that a run killed
before its checkpoint wrote, so a resumed run lists each step once), and, when a
`WandbLogger` is attached, to a W&B table `val/samples`.

`SpeculativeEval` is a `SpecdecCallback` (`train.callbacks.base`): it checks that what it decodes
fits its settings (gamma, prompt and generation lengths) before the run starts, and offers its
speed profiles to the export.

Decoding runs in fp32 on the module's parameters (autocast off, also under bf16-mixed), in eval
mode under `torch.inference_mode`, prepared for the device as the decoding CLI prepares its models
(`specdec_models.cpu.prepare_for_device`, their dtypes kept; switched back after each evaluation),
with a generator seeded the same way at every evaluation so
samples compare across steps. Under DDP only global rank 0 decodes; the other ranks wait at a
barrier. Metrics are logged with `rank_zero_only=True` (not usable as a checkpoint monitor).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from torch import Tensor, nn

from specdec_models import ModelWithProphet, byte_tokenizer
from specdec_models.cpu import prepare_for_device
from specdec_models.decode import SamplingConfig, SpeedProfile, TreeDrafter, generate
from specdec_models.decode.cost import StepTimes, measure_costs
from specdec_models.decode.tree import TreeSpec
from specdec_models.errors import SpecdecError, check, check_positive_int
from specdec_models.files import write_file
from specdec_models.heads import DraftHead, Eagle3Head
from specdec_models.hf import HFDecoder

from ..data.settings import read_settings
from ..data.streams import SpecdecDataModule
from ..tasks.base import SpeculativeModels
from .base import SpecdecCallback

SAMPLES_FILE = "speculative_samples.jsonl"
TABLE_KEY = "val/samples"


def _sample_lines(path: Path) -> list[str]:
    """The complete JSON lines of a samples file (none if it is absent; a line a kill cut short is dropped)."""
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if isinstance(json.loads(line), dict):
                lines.append(line)
        except ValueError:
            continue
    return lines


def temperature_tag(temperature: float) -> str:
    """The metric suffix of a temperature: 0 -> 't0', 1.0 -> 't1', 0.7 -> 't0.7'."""
    return f"t{float(temperature):g}"


def torch_modules(models: SpeculativeModels) -> list[nn.Module]:
    """The nn.Modules behind the models to decode with (a Hugging Face model behind its HFDecoder)."""
    found = [models.target, models.draft, models.prophet]
    return [m.model if isinstance(m, HFDecoder) else m for m in found if m is not None]


TREE_FORMAT = "depth,topk,width[,lookup[..max]][,min_prob][,keep=p][,nodes=n]"


@dataclass(frozen=True)
class EvalSettings:
    """The `callbacks.speculative_eval` node. `num_prompts` fixed prompts of `prompt_len` bytes
    from `trainer.datamodule.prompts`, `max_new_tokens` new bytes each, `gamma` drafts per round,
    one decoding per temperature. `num_threads`: CPU threads while decoding (None: the process's
    setting). Decoding a few rows is a chain of small latency-bound ops: on a CPU shared with
    other work, one thread can be many times faster than two that wait for each other.
    `choose_gamma`: time the cost ratios and pick the best gamma in 1..gamma per temperature and
    batch size (module docstring). `tree` (`TREE_FORMAT`, an EAGLE-3 head only): also decode with
    that draft tree (`decode.tree`), rows one after another as tree drafting runs, and log it
    beside the chain (module docstring). `every`: decode at every `every`-th validation, and at
    the one that ends training; a run stopped by `max_time` counts the decoding in its budget, so
    a short run spends fewer of its minutes on it."""

    num_prompts: int = 4
    prompt_len: int = 64
    max_new_tokens: int = 64
    gamma: int = 5
    temperatures: Sequence[float] = (0.0, 1.0)
    seed: int = 0
    samples_dir: str | None = None
    num_threads: int | None = None
    choose_gamma: bool = True
    tree: str | None = None
    every: int = 1

    def __post_init__(self) -> None:
        for name in ("num_prompts", "prompt_len", "max_new_tokens", "gamma"):
            check_positive_int(getattr(self, name), f"speculative_eval.{name}")
        temperatures = [float(t) for t in self.temperatures]
        check(len(temperatures) > 0 and all(t >= 0 and math.isfinite(t) for t in temperatures),
              f"speculative_eval.temperatures must be a non-empty list of numbers >= 0, got {temperatures!r}")
        check(len({temperature_tag(t) for t in temperatures}) == len(temperatures),
              f"speculative_eval.temperatures has duplicates: {temperatures!r}")
        object.__setattr__(self, "temperatures", temperatures)
        check(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
              f"speculative_eval.num_threads must be a positive integer or null, got {self.num_threads!r}")
        check(isinstance(self.choose_gamma, bool),
              f"speculative_eval.choose_gamma must be true or false, got {self.choose_gamma!r}")
        check(self.tree is None or isinstance(self.tree, str),
              f"speculative_eval.tree must be \"{TREE_FORMAT}\" or null, got {self.tree!r}")
        check(isinstance(self.every, int) and not isinstance(self.every, bool) and self.every >= 0,
              f"speculative_eval.every must be an integer >= 0 (0: only at the end of training), got {self.every!r}")


class SpeculativeEval(SpecdecCallback):
    def __init__(self, **settings: Any) -> None:
        """`settings`: the fields of `EvalSettings` (the config node, checked there)."""
        super().__init__()
        s = read_settings(EvalSettings, type(self), settings)
        self.num_prompts, self.prompt_len, self.max_new_tokens = s.num_prompts, s.prompt_len, s.max_new_tokens
        self.gamma, self.temperatures, self.seed = s.gamma, s.temperatures, s.seed
        self.samples_dir, self.num_threads, self.choose_gamma = s.samples_dir, s.num_threads, s.choose_gamma
        self.tree = None if s.tree is None else TreeSpec.parse(s.tree)
        self.every = s.every
        self._validations = 0                   # validations seen (checkpointed, so a resumed run keeps the rhythm)
        # the last evaluation's speed profiles, one per temperature and batch size (checkpointed)
        self.speed_profiles: list[dict[str, Any]] = []
        self._prompts: Tensor | list[Tensor] | None = None
        self.last_metrics: dict[str, float] = {}
        self.text = byte_tokenizer.decode       # tokens -> text of the samples; the DataModule's decode_text if any

    # -- the evaluation itself (no trainer needed: specdec bench train times it alone) --------

    def check_module(self, module: L.LightningModule) -> None:
        """What the module's `speculative_models()` decode fits this callback's settings."""
        self.check_model(module.speculative_models())

    def export_metadata(self) -> dict[str, Any]:
        """The last evaluation's speed profiles, for `--gamma auto` of the export's users."""
        return {"speed_profiles": self.speed_profiles} if self.speed_profiles else {}

    def check_model(self, models: ModelWithProphet | SpeculativeModels) -> SpeculativeModels:
        """The models to decode with, checked: a ModelWithProphet is its main model drafted by
        its prophet; any prophet (a ModelWithProphet, a Hugging Face target's HFProphet head)
        must draft gamma tokens per round."""
        if isinstance(models, ModelWithProphet):
            models = SpeculativeModels(target=models.model, prophet=models)
        check(isinstance(models, SpeculativeModels),
              f"SpeculativeEval needs a ModelWithProphet or SpeculativeModels, got {type(models).__name__}")
        if models.prophet is not None:
            check(isinstance(models.prophet, DraftHead),
                  f"SpeculativeEval: a prophet must be a ModelWithProphet, an HFProphet or an Eagle3Head, got "
                  f"{type(models.prophet).__name__}")
            if self.tree is not None:
                check(isinstance(models.prophet, Eagle3Head),
                      f"speculative_eval.tree drafts with an EAGLE-3 head only, not a {type(models.prophet).__name__}")
                check(models.prophet.max_gamma >= self.tree.depth,
                      f"speculative_eval.tree's depth ({self.tree.depth}) exceeds what the head drafts "
                      f"({models.prophet.max_gamma})")
            check(models.prophet.max_gamma >= self.gamma,
                  f"speculative_eval.gamma ({self.gamma}) needs a head that drafts gamma tokens per round: "
                  f"it drafts {models.prophet.max_gamma} (a prophet's prophet_train_length - 1)")
        longest = self.prompt_len + self.max_new_tokens
        for role, model in (("target", models.target), ("draft", models.draft)):
            check(model is None or model.cfg.max_seq_len >= longest,
                  f"speculative_eval.prompt_len + max_new_tokens = {longest} exceeds the {role}'s max_seq_len "
                  f"{model.cfg.max_seq_len if model is not None else ''}: lower one of them")
        return models

    @torch.inference_mode()
    def evaluate(self, models: ModelWithProphet | SpeculativeModels,
                 prompts: Tensor | list[Tensor]) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Decode `prompts` (K, prompt_len), or K 1-D prompts of their own lengths, at each
        temperature, speculatively and plainly; return (metrics named as in the module
        docstring, one sample record per prompt and temperature). Runs in eval mode and fp32
        (autocast off), prepared for the device (`specdec_models.cpu.prepare_for_device`, dtypes
        kept), and restores the modules' training flags and layers."""
        models = self.check_model(models)
        device = models.target.device
        prompts = prompts.to(device) if isinstance(prompts, Tensor) else [p.to(device) for p in prompts]
        modules = torch_modules(models)
        modes = {m: m.training for model in modules for m in model.modules()}
        for model in modules:
            model.eval()
        threads = torch.get_num_threads()
        if self.num_threads is not None and device.type == "cpu":
            torch.set_num_threads(self.num_threads)
        autocast_off = torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else nullcontext()
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        samples: list[dict[str, Any]] = []
        try:
            with autocast_off, prepare_for_device(modules, device, dtype=None):
                costs = self._measure_costs(models, prompts) if self.choose_gamma else {}
                profiles = []
                for temperature in self.temperatures:
                    m, s, p = self._evaluate_at(models, prompts, temperature, device, costs)
                    metrics.update(m)
                    samples.extend(s)
                    profiles.extend(p)
                if self.choose_gamma:
                    self.speed_profiles = profiles
        finally:
            torch.set_num_threads(threads)
            for module, training in modes.items():
                module.training = training
        metrics["val/spec_eval_seconds"] = time.perf_counter() - t0
        return metrics, samples

    def _generator(self, device: torch.device, temperature: float) -> torch.Generator:
        # the same stream at every evaluation, a different one per temperature
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + int(round(temperature * 1000)))

    def _measure_costs(self, models: SpeculativeModels, prompts: Tensor | list[Tensor]) -> dict[int, StepTimes]:
        """Model-call times {batch: StepTimes} for c and v(1..gamma), at batch 1 and the prompts'
        batch, on KV caches holding about as many tokens as the evaluation's mid-point."""
        context = max(len(p) for p in prompts) + self.max_new_tokens // 2
        return {b: measure_costs(models.target, b, context, list(range(1, self.gamma + 1)), models.drafter(),
                                 steps=8, warmup=2)
                for b in sorted({1, len(prompts)})}

    def _speed_profiles(self, spec: dict[str, Any], base: dict[str, Any], costs: dict[int, StepTimes],
                        batch: int, temperature: float, tag: str,
                        one_pass: bool = False) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Predicted speed-ups and the best gamma per batch size from this temperature's
        per-position acceptance (see the module docstring); (metrics, profiles as dicts)."""
        acceptance = spec["per_position_acceptance"]
        run = SpeedProfile.from_times(StepTimes.from_dict(spec["step_times"]), acceptance, batch,
                                      StepTimes.from_dict(base["step_times"]), one_pass)
        metrics = {f"val/predicted_speedup/{tag}": run.predicted(self.gamma)}
        profiles = []
        for b, times in costs.items():
            profile = SpeedProfile.from_times(times, acceptance, b, one_pass=one_pass)
            if b == batch:      # the run's own v(gamma) and c at its batch size are the better measurement
                profile = SpeedProfile(run.c, {**profile.v_by_gamma, self.gamma: run.v(self.gamma)}, acceptance, b,
                                       one_pass)
            best = profile.best_gamma(plain=True)        # 0: no gamma beats plain decoding (batch 8 on a CPU)
            metrics[f"val/best_gamma/b{b}/{tag}"] = best
            metrics[f"val/best_predicted_speedup/b{b}/{tag}"] = profile.predicted(best)
            profiles.append({"temperature": temperature, **profile.to_dict()})
        return metrics, profiles

    def _evaluate_at(self, models: SpeculativeModels, prompts: Tensor, temperature: float, device: torch.device,
                     costs: dict[int, StepTimes],
                     ) -> tuple[dict[str, float], list[dict[str, Any]], list[dict[str, Any]]]:
        tag = temperature_tag(temperature)
        target, drafter = models.target, models.drafter()
        decode = dict(max_new_tokens=self.max_new_tokens, gamma=self.gamma, sampling=SamplingConfig(temperature))
        # warm-up (a few tokens, same batch): first calls at a shape pay one-time costs that would
        # skew the timing
        warm = dict(decode, max_new_tokens=min(self.max_new_tokens, 2 * self.gamma + 2))
        generate(target, prompts, drafter=drafter, generator=self._generator(device, temperature), **warm)
        generate(target, prompts, generator=self._generator(device, temperature), **warm)

        timing = bool(costs)
        spec_tokens, spec = generate(target, prompts, drafter=drafter, generator=self._generator(device, temperature),
                                     timing=timing, **decode)
        base_tokens, base = generate(target, prompts, generator=self._generator(device, temperature),
                                     timing=timing, **decode)
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
        if self.tree is not None:
            metrics.update(self._evaluate_tree(models, prompts, temperature, device, tag))
        profiles: list[dict[str, Any]] = []
        if costs:
            try:
                predicted, profiles = self._speed_profiles(spec, base, costs, len(prompts), temperature, tag,
                                                           getattr(drafter, "one_pass", False))
                metrics.update(predicted)
            except SpecdecError:      # too few tokens for a draft step or a verify call: nothing to predict
                profiles = []
        metrics = {k: float("nan") if v is None else float(v) for k, v in metrics.items()}
        samples = []
        for row, (prompt, new, plain) in enumerate(zip(prompts, spec_tokens, base_tokens, strict=False)):
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
        return metrics, samples, profiles

    def _evaluate_tree(self, models: SpeculativeModels, prompts: Tensor | list[Tensor], temperature: float,
                       device: torch.device, tag: str) -> dict[str, float]:
        """Tree drafting on the same prompts, rows one after another (as `decode.tree` runs them),
        against plain decoding also one row at a time: tokens per call, the fraction of rounds
        that accepted at least i tokens, and the wall-time ratio."""
        rows = list(prompts)
        decode = dict(max_new_tokens=self.max_new_tokens, sampling=SamplingConfig(temperature))
        warm = dict(decode, max_new_tokens=min(self.max_new_tokens, 2 * self.tree.depth + 2))
        drafter = TreeDrafter(models.prophet, self.tree)
        generate(models.target, rows[:1], drafter=drafter, generator=self._generator(device, temperature), **warm)
        _, tree = generate(models.target, rows, drafter=drafter, generator=self._generator(device, temperature),
                           **decode)
        t0 = time.perf_counter()
        for row in rows:
            generate(models.target, [row], generator=self._generator(device, temperature), **decode)
        base_seconds = time.perf_counter() - t0
        metrics = {f"val/tree/tokens_per_call/{tag}": tree.tokens_per_call,
                   f"val/tree/speedup/{tag}": base_seconds / max(tree.wall_seconds, 1e-12)}
        for i, rate in enumerate(tree.per_position_acceptance, start=1):
            metrics[f"val/tree/per_position_acceptance/pos{i}/{tag}"] = rate
        return metrics

    # -- Lightning hooks -------------------------------------------------------------------------

    def prompts(self, trainer: L.Trainer) -> Tensor | list[Tensor]:
        """The K fixed validation prompts (fetched once from the DataModule): a (K, prompt_len)
        tensor, or K 1-D tensors (a DataModule whose rows start with prompts of their own)."""
        if self._prompts is None:
            datamodule = trainer.datamodule
            if not isinstance(datamodule, SpecdecDataModule):
                raise SpecdecError("SpeculativeEval needs a SpecdecDataModule (train.data.streams) to draw prompts "
                                   "from: pass it as trainer.fit(module, datamodule=...)")
            prompts = datamodule.prompts(self.num_prompts, self.prompt_len)
            self._prompts = (prompts.long().cpu() if isinstance(prompts, Tensor)
                             else [p.long().cpu() for p in prompts])
            self.text = datamodule.decode_text
        return self._prompts

    def state_dict(self) -> dict[str, Any]:
        return {"speed_profiles": self.speed_profiles, "validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.speed_profiles = list(state_dict.get("speed_profiles", []))
        self._validations = int(state_dict.get("validations", 0))

    def due(self, trainer: L.Trainer) -> bool:
        """Whether this validation decodes: every `every`-th one (none with `every` 0), and the
        one that ends training (a stop signalled by `max_time` or a callback, the step budget
        reached, or the last batch of the last epoch)."""
        self._validations += 1
        if self.every == 1 or (self.every and self._validations % self.every == 0) or trainer.should_stop:
            return True
        if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
            return True
        last_epoch = trainer.max_epochs is not None and 0 < trainer.max_epochs <= trainer.current_epoch + 1
        return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.due(trainer):
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
        path = directory / SAMPLES_FILE
        # a run resumed from a checkpoint before this step may have written this step's samples (and
        # later ones) before it was killed: they are dropped, as the metrics CSV drops its rows
        kept = [line for line in _sample_lines(path) if json.loads(line).get("step", -1) < step]
        text = "".join(line + "\n" for line in kept) + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        write_file(path, lambda f: f.write(text.encode("utf-8")))
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                columns = list(rows[0])
                logger.log_table(key=TABLE_KEY, columns=columns, data=[[r[c] for c in columns] for r in rows],
                                 step=step)
