"""Training-pipeline overhead: the Lightning pipeline against a plain PyTorch loop, interleaved.

`bench_pipeline` runs `python -m train`'s own `train.run.run` (task=prophet, its config composed
by `train.run.compose`) with one more callback, `Interleave`, against `PlainLoop`, a plain loop
over a copy of the same `ModelWithProphet` (copied when the fit starts: same initial weights;
same optimizer, schedule, gradient clipping, precision via `torch.autocast("cpu", torch.bfloat16)`
for bf16-mixed) on the very batches the pipeline drew. Both run in one process, interleaved:
`Interleave` runs the plain loop on the last N batches after every N pipeline steps (warm-up
first), so load on the machine hits both alike. Ratio = pipeline tokens/s / plain tokens/s. The
speculative-decoding evaluation callback is off for the ratio; one evaluation (its config from
conf/callbacks) is timed separately (`time_eval`). The comparison with lucidrains' and time-to-quality live
in `train.bench.train_step` and `train.bench.train_quality` (no Lightning there).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch

from specdec_models import ModelWithProphet
from specdec_models.errors import check

from ..optim import OptimConfig
from ..run import compose, run

PRECISIONS = ("32-true", "bf16-mixed")


class PlainLoop:
    """What one would write by hand: autocast forward, backward, clip, optimizer and schedule step."""

    def __init__(self, net: ModelWithProphet, optim: dict | None, total_steps: int, clip: float | None,
                 precision: str = "32-true") -> None:
        check(precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        cfg = OptimConfig.from_dict(dict(optim or {}))        # the same optimizer settings as the pipeline
        self.net = net.train()
        decay = [p for p in net.parameters() if p.ndim >= 2 and p.requires_grad]
        rest = [p for p in net.parameters() if p.ndim < 2 and p.requires_grad]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        self.optimizer = cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: cfg.lr_factor(s, total_steps))
        self.clip = clip
        self.bf16 = precision == "bf16-mixed"

    def step(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> float:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with autocast:
            loss = self.net(batch, generator=generator).loss
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.detach())


class Interleave(L.Callback):
    """After the pipeline's warm-up and after each round of `steps` pipeline batches, run the plain
    loop on the same batches; time both, round by round and step by step. The plain loop is built
    when the fit starts, by `make_plain(net)` on a copy of the module's network (same weights)."""

    def __init__(self, make_plain: Callable[[ModelWithProphet], PlainLoop], warmup: int, steps: int) -> None:
        self.make_plain, self.warmup, self.steps = make_plain, warmup, steps
        self.plain: PlainLoop | None = None
        self.module, self.datamodule = None, None       # the fitted ones, for `time_eval`
        self.done, self.batches, self.start, self.last = 0, [], None, None
        self.pipeline_s: list[float] = []
        self.plain_s: list[float] = []
        self.pipeline_steps: list[float] = []
        self.plain_steps: list[float] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        self.module, self.datamodule = pl_module, trainer.datamodule
        self.plain = self.make_plain(copy.deepcopy(pl_module.net))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.done += 1
        timed = self.done > self.warmup
        if timed:
            self.pipeline_steps.append(now - self.last)      # one whole iteration: data, step, hooks, logs
        self.batches.append(batch.detach().clone())
        if self.done < self.warmup or (self.done - self.warmup) % self.steps:
            self.last = time.perf_counter()
            return
        if timed:
            self.pipeline_s.append(now - self.start)
        t0 = time.perf_counter()
        for b in self.batches:
            s0 = time.perf_counter()
            self.plain.step(b)
            if timed:
                self.plain_steps.append(time.perf_counter() - s0)
        if timed:
            self.plain_s.append(time.perf_counter() - t0)
        self.batches = []
        self.start = self.last = time.perf_counter()


@dataclass
class PipelineBench:
    model: str = "mid"
    precisions: list[str] = field(default_factory=lambda: list(PRECISIONS))
    warmup: int = 2
    steps: int = 4
    rounds: int = 3
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check(min(self.warmup, self.steps, self.rounds) >= 1, "--warmup, --steps and --rounds must be >= 1")
        for p in self.precisions:
            check(p in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {p!r}")


def bench_pipeline(bench: PipelineBench, path: Path, data_desc: str, workdir: Path) -> dict[str, Any]:
    """Pipeline vs plain loop per precision on the byte file `path`; the report (a dict). The
    pipeline is `run(cfg)` itself, wired as `python -m train` wires it, writing into
    `workdir/<precision>`."""
    from omegaconf import OmegaConf

    total = bench.warmup + bench.rounds * bench.steps
    rows, eval_result, cfg = [], None, None
    for precision in bench.precisions:
        overrides = [f"model={bench.model}", "trainer=cpu", "logger=csv", f"data.path={path}",
                     "data.allow_short=true", f"output_dir={workdir / precision}", f"trainer.max_steps={total}",
                     f"trainer.precision={precision}", "trainer.num_sanity_val_steps=0", *bench.overrides]
        cfg = compose(overrides)
        check(cfg.task.name == "prophet", f"the plain loop trains a prophet and its main model: keep task=prophet, "
                                          f"got task={cfg.task.name}")
        check(int(cfg.trainer.accumulate_grad_batches) == 1,
              "the benchmark counts one batch per optimizer step: keep trainer.accumulate_grad_batches=1")
        check(cfg.model.prophet.get("windows_per_seq") is None,
              "the plain loop draws no window subsets: benchmark windows_per_seq with --lucidrains")
        val_interval = int(cfg.trainer.val_check_interval)
        cfg.trainer.val_check_interval = 10 ** 6           # no validation inside the timed fit
        eval_node = cfg.callbacks.get("speculative_eval")
        cfg.callbacks.speculative_eval = None              # off for the ratio; timed alone below
        optim, clip = OmegaConf.to_container(cfg.optim, resolve=True), cfg.trainer.get("gradient_clip_val")
        interleave = Interleave(functools.partial(PlainLoop, optim=optim, total_steps=total, clip=clip,
                                                  precision=precision), bench.warmup, bench.steps)
        print(f"[{precision}] {bench.warmup} warm-up steps, then {bench.rounds} rounds of {bench.steps} steps "
              "each side", file=sys.stderr)
        run(cfg, callbacks=[interleave])
        rows.append(_pipeline_row(precision, interleave, bench.steps * cfg.data.batch_size * cfg.data.seq_len))
        if eval_node is not None and eval_result is None:
            eval_result = time_eval(eval_node, interleave.module, interleave.datamodule, val_interval,
                                    rows[-1]["seconds_per_step_pipeline"])
    assert cfg is not None
    return {
        "mode": "pipeline", "model": bench.model,
        "main": OmegaConf.to_container(cfg.model.main), "prophet": OmegaConf.to_container(cfg.model.prophet),
        "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size,
        "data": data_desc, "warmup_steps": bench.warmup, "steps_per_round": bench.steps, "rounds": bench.rounds,
        "overrides": list(bench.overrides), "results": rows, "speculative_eval": eval_result,
    }


def _pipeline_row(precision: str, run: Interleave, tokens_per_round: int) -> dict[str, Any]:
    """One precision's figures; `weights_max_abs_diff`: how far the two sides' weights ended apart
    (both trained the same steps on the same batches: ~0 in fp32, rounding in bf16-mixed)."""
    per_round = [p / q for p, q in zip(run.plain_s, run.pipeline_s, strict=True)]
    pipeline_weights, plain_weights = run.module.net.state_dict(), run.plain.net.state_dict()
    diff = max(float((pipeline_weights[k].float() - v.float()).abs().max()) for k, v in plain_weights.items())
    pipe = tokens_per_round * len(run.pipeline_s) / sum(run.pipeline_s)
    base = tokens_per_round * len(run.plain_s) / sum(run.plain_s)
    return {
        "precision": precision, "pipeline_tokens_per_second": pipe, "plain_tokens_per_second": base,
        "ratio": pipe / base, "ratio_median_round": statistics.median(per_round),
        # median step times: robust to bursts of other load on a shared machine
        "ratio_median_step": statistics.median(run.plain_steps) / statistics.median(run.pipeline_steps),
        "ratio_per_round": per_round, "pipeline_step_seconds": run.pipeline_steps,
        "plain_step_seconds": run.plain_steps, "pipeline_seconds_per_round": run.pipeline_s,
        "plain_seconds_per_round": run.plain_s,
        "seconds_per_step_pipeline": sum(run.pipeline_s) / (run.steps * len(run.pipeline_s)),
        "weights_max_abs_diff": diff,
    }


def time_eval(node, module, datamodule, val_interval: int, step_seconds: float) -> dict[str, Any]:
    """One SpeculativeEval evaluation on the trained module, timed alone (fp32, as in training)."""
    from hydra.utils import instantiate

    callback = instantiate(node)
    prompts = datamodule.prompts(callback.num_prompts, callback.prompt_len)
    t0 = time.perf_counter()
    metrics, _ = callback.evaluate(module.net, prompts)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "settings": {k: getattr(callback, k) for k in ("num_prompts", "prompt_len", "max_new_tokens", "gamma",
                                                       "temperatures")},
        "val_check_interval": val_interval,
        "share_of_training_time": seconds / (seconds + val_interval * step_seconds),
        "metrics": metrics,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [f"model={result['model']}, seq {result['seq_len']}, batch {result['batch_size']}, {result['rounds']} "
             f"rounds x {result['steps_per_round']} steps each side after {result['warmup_steps']} warm-up steps; "
             f"data: {result['data']}", "",
             "| precision | pipeline tokens/s | plain loop tokens/s | pipeline / plain (total time) | "
             "median of rounds | median step |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['precision']} | {r['pipeline_tokens_per_second']:,.0f} | "
                     f"{r['plain_tokens_per_second']:,.0f} | {r['ratio']:.3f} | {r['ratio_median_round']:.3f} | "
                     f"{r['ratio_median_step']:.3f} |")
    ev = result.get("speculative_eval")
    if ev:
        s = ev["settings"]
        lines.append("")
        lines.append(f"Speculative-decoding evaluation (not in the ratio): {ev['seconds']:.1f} s per validation "
                     f"({s['num_prompts']} prompts x {s['max_new_tokens']} tokens, gamma {s['gamma']}, temperatures "
                     f"{s['temperatures']}); every {ev['val_check_interval']} steps that is "
                     f"{100 * ev['share_of_training_time']:.1f}% of training time.")
    return "\n".join(lines)
