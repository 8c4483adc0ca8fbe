"""Training throughput: the Lightning pipeline against a plain PyTorch loop, and our train step
against the reference implementation's figures.

    python scripts/bench_train.py [--data PATH] [--precisions 32-true bf16-mixed]
    python scripts/bench_train.py --reference [--windows-per-seq 64 128]

Default mode: `ProphetModule` (task=prophet) driven by a Lightning Trainer built from the run's config
(`model=mid trainer=cpu logger=csv`, composed from conf/ as `python -m train` does; extra Hydra
overrides via `--override`), against a plain loop over a copy of the same `ModelWithProphet`
(same initial weights, optimizer, schedule, gradient clipping, precision via
`torch.autocast("cpu", torch.bfloat16)` for bf16-mixed) on the very batches the pipeline drew.
Both run in one process, interleaved: a callback inside the pipeline's fit runs the plain loop
for N steps after every N pipeline steps (warm-up first), so load on the machine hits both
alike. Ratio = pipeline tokens/s / plain tokens/s (goal >= 0.97). The speculative-decoding
evaluation callback is off for the ratio; one evaluation (its config from conf/callbacks) is
timed separately. Writes bench/train.json.

`--reference`: our joint train step (forward + backward + AdamW step, fp32, seq 512, batch 4,
every prophet window, or `--windows-per-seq K` random ones) for main 256x4 + prophet 256x1 and
main 512x10 + prophet 512x2 (heads of 64), against the reference implementation's ~1,080 and
~200 tokens/s on this machine (goal >= 1.3x). Writes bench/train_reference.json.

Tokens per step = batch x seq_len (the main model's predicted positions).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from specdec_models import ModelConfig, ModelWithProphet, ProphetConfig
from specdec_models.errors import SpecdecError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "textmix100m.gz"
# the reference implementation's training tokens/s on this machine (fp32, seq 512, batch 4)
REFERENCE_SIZES = {
    "256x4+256x1": dict(dim=256, depth=4, prophet_depth=1, reference_tokens_per_second=1080.0),
    "512x10+512x2": dict(dim=512, depth=10, prophet_depth=2, reference_tokens_per_second=200.0),
}


# -- the plain loop --------------------------------------------------------------------------------

class PlainLoop:
    """What one would write by hand: autocast forward, backward, clip, optimizer and schedule step."""

    def __init__(self, net: ModelWithProphet, optim: dict | None, total_steps: int, clip: float | None,
                 precision: str = "32-true") -> None:
        from train.optim import OptimConfig   # the same optimizer settings as the pipeline

        cfg = OptimConfig.from_dict(dict(optim or {}))
        self.net = net.train()
        decay = [p for p in net.parameters() if p.ndim >= 2 and p.requires_grad]
        rest = [p for p in net.parameters() if p.ndim < 2 and p.requires_grad]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        self.optimizer = cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: cfg.lr_factor(s, total_steps))
        self.clip = clip
        check_precision(precision)
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


def check_precision(precision: str) -> None:
    if precision not in ("32-true", "bf16-mixed"):
        raise SystemExit(f"precision must be 32-true or bf16-mixed, got {precision!r}")


# -- data ------------------------------------------------------------------------------------------

def data_file(path: str | None, workdir: Path) -> tuple[Path, str]:
    """The byte file to train on: `path`, the shared text file, or synthetic bytes written to workdir."""
    if path:
        if not Path(path).is_file():
            raise SystemExit(f"--data {path} is not a file")
        return Path(path), str(path)
    if DEFAULT_DATA.is_file():
        return DEFAULT_DATA, str(DEFAULT_DATA)
    synthetic = workdir / "synthetic.bin"
    synthetic.write_bytes(np.random.default_rng(0).integers(32, 127, 4_000_000, dtype=np.uint8).tobytes())
    return synthetic, "synthetic bytes (4 MB)"


# -- pipeline vs plain -----------------------------------------------------------------------------

def make_interleave_callback(plain: PlainLoop, warmup: int, steps: int, rounds: int):
    import lightning as L

    class Interleave(L.Callback):
        """After the pipeline's warm-up and after each round of `steps` pipeline batches, run the
        plain loop on the same batches; time both, round by round and step by step."""

        def __init__(self) -> None:
            self.done, self.batches, self.start, self.last = 0, [], None, None
            self.pipeline_s: list[float] = []
            self.plain_s: list[float] = []
            self.pipeline_steps: list[float] = []
            self.plain_steps: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            self.done += 1
            timed = self.done > warmup
            if timed:
                self.pipeline_steps.append(now - self.last)      # one whole iteration: data, step, hooks, logs
            self.batches.append(batch.detach().clone())
            if self.done < warmup or (self.done - warmup) % steps:
                self.last = time.perf_counter()
                return
            if timed:
                self.pipeline_s.append(now - self.start)
            t0 = time.perf_counter()
            for b in self.batches:
                s0 = time.perf_counter()
                plain.step(b)
                if timed:
                    self.plain_steps.append(time.perf_counter() - s0)
            if timed:
                self.plain_s.append(time.perf_counter() - t0)
            self.batches = []
            self.start = self.last = time.perf_counter()

    return Interleave()


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def bench_pipeline(args, workdir: Path) -> dict:
    import lightning as L
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from train.tasks.prophet import ProphetModule
    from train.run import build_callbacks, build_loggers, validate

    path, data_desc = data_file(args.data, workdir)
    total = args.warmup + args.rounds * args.steps
    rows, eval_result, cfg = [], None, None
    for precision in args.precisions:
        check_precision(precision)
        overrides = [f"model={args.model}", "trainer=cpu", "logger=csv", f"data.path={path}", "data.allow_short=true",
                     f"output_dir={workdir / precision}", f"trainer.max_steps={total}", f"trainer.precision={precision}",
                     "trainer.num_sanity_val_steps=0", *args.override]
        cfg = compose(overrides)
        accumulate = int(cfg.trainer.accumulate_grad_batches)
        if accumulate != 1:
            raise SystemExit("the benchmark counts one batch per optimizer step: keep trainer.accumulate_grad_batches=1")
        val_interval = int(cfg.trainer.val_check_interval)
        cfg.trainer.val_check_interval = 10 ** 6           # no validation inside the timed fit
        eval_node = cfg.callbacks.get("speculative_eval")
        cfg.callbacks.speculative_eval = None              # off for the ratio; timed alone below
        kwargs = validate(cfg)
        main, prophet = ModelConfig.from_dict(kwargs["main"]), ProphetConfig.from_dict(kwargs["prophet"])
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        L.seed_everything(cfg.seed, verbose=False)
        datamodule = instantiate(cfg.data)
        datamodule.prepare_data()
        datamodule.setup("fit")
        module = ProphetModule(**kwargs)
        if prophet.windows_per_seq is not None:
            raise SystemExit("the plain loop draws no window subsets: benchmark windows_per_seq with --reference")
        twin = ModelWithProphet(main, prophet)
        twin.load_state_dict(module.net.state_dict())
        plain = PlainLoop(twin, OmegaConf.to_container(cfg.optim, resolve=True), total,
                          cfg.trainer.get("gradient_clip_val"), precision)
        interleave = make_interleave_callback(plain, args.warmup, args.steps, args.rounds)
        trainer = instantiate(cfg.trainer, logger=build_loggers(cfg, out) or False,
                              callbacks=build_callbacks(cfg) + [interleave])
        print(f"[{precision}] {args.warmup} warm-up steps, then {args.rounds} rounds of {args.steps} steps each side",
              file=sys.stderr)
        trainer.fit(module, datamodule=datamodule)
        tokens = args.steps * cfg.data.batch_size * cfg.data.seq_len
        pipe = tokens * len(interleave.pipeline_s) / sum(interleave.pipeline_s)
        base = tokens * len(interleave.plain_s) / sum(interleave.plain_s)
        per_round = [p / q for p, q in zip(interleave.plain_s, interleave.pipeline_s)]
        rows.append({
            "precision": precision,
            "pipeline_tokens_per_second": pipe,
            "plain_tokens_per_second": base,
            "ratio": pipe / base,
            "ratio_median_round": statistics.median(per_round),
            # median step times: robust to bursts of other load on a shared machine
            "ratio_median_step": statistics.median(interleave.plain_steps) / statistics.median(interleave.pipeline_steps),
            "ratio_per_round": per_round,
            "pipeline_step_seconds": interleave.pipeline_steps,
            "plain_step_seconds": interleave.plain_steps,
            "pipeline_seconds_per_round": interleave.pipeline_s,
            "plain_seconds_per_round": interleave.plain_s,
            "seconds_per_step_pipeline": sum(interleave.pipeline_s) / (args.steps * len(interleave.pipeline_s)),
        })
        if eval_node is not None and eval_result is None:
            eval_result = time_eval(eval_node, module, datamodule, val_interval, rows[-1]["seconds_per_step_pipeline"])
    assert cfg is not None
    return {
        "mode": "pipeline",
        "model": args.model,
        "main": OmegaConf.to_container(cfg.model.main), "prophet": OmegaConf.to_container(cfg.model.prophet),
        "seq_len": cfg.data.seq_len, "batch_size": cfg.data.batch_size,
        "data": data_desc, "warmup_steps": args.warmup, "steps_per_round": args.steps, "rounds": args.rounds,
        "overrides": list(args.override), "results": rows, "speculative_eval": eval_result,
    }


def time_eval(node, module, datamodule, val_interval: int, step_seconds: float) -> dict:
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


# -- our train step vs the reference implementation's figures --------------------------------------

def bench_reference(args, workdir: Path) -> dict:
    from train.data.enwik8 import RandomWindows, read_bytes

    path, data_desc = data_file(args.data, workdir)
    data = read_bytes(path)[: 90_000_000]
    seq_len, batch = 512, 4
    rows = []
    for name, size in REFERENCE_SIZES.items():
        if args.sizes and name not in args.sizes:
            continue
        dim, heads = size["dim"], size["dim"] // 64
        main = ModelConfig(dim=dim, depth=size["depth"], heads=heads, dim_head=64, max_seq_len=1024)
        for k in [None, *args.windows_per_seq]:
            prophet = ProphetConfig(model=ModelConfig(dim=dim, depth=size["prophet_depth"], heads=heads, dim_head=64,
                                                      max_seq_len=64),
                                    prophet_train_length=7, num_leading_start_tokens=2, windows_per_seq=k)
            torch.manual_seed(0)
            net = ModelWithProphet(main, prophet)
            if args.compile:
                net.compile()                   # as the pipeline's compile=true does; compiles at the first step
            loop = PlainLoop(net, {"name": "adamw", "lr": 1e-4, "warmup_steps": 0}, total_steps=10 ** 6, clip=None)
            windows = RandomWindows(data, seq_len, batch, seed=0, rank=0, start=0)
            generator = torch.Generator().manual_seed(0)
            warmup, steps = (2, args.ref_steps or 12) if dim == 256 else (2, args.ref_steps or 5)
            t0 = time.perf_counter()
            for i in range(warmup):
                loop.step(windows.batch(i), generator)
            warmup_seconds = time.perf_counter() - t0
            times = []
            for i in range(steps):
                t0 = time.perf_counter()
                loop.step(windows.batch(warmup + i), generator)
                times.append(time.perf_counter() - t0)
            # the median step is the figure; the best step shows how much other load on the
            # machine slowed the rest down
            tps = batch * seq_len / statistics.median(times)
            ref = size["reference_tokens_per_second"]
            windows_count = k if k is not None else prophet.anchor_count(seq_len)
            rows.append({"size": name, "windows_per_seq": k, "prophet_windows": windows_count, "steps": steps,
                         "compiled": args.compile, "warmup_seconds": warmup_seconds,
                         "seconds_per_step": statistics.median(times), "step_seconds": times,
                         "tokens_per_second": tps, "best_step_tokens_per_second": batch * seq_len / min(times),
                         "reference_tokens_per_second": ref, "vs_reference": tps / ref})
            print(f"[{name} windows={k or 'all'}{' compiled' if args.compile else ''}] {tps:,.0f} tokens/s "
                  f"(median step; warm-up {warmup_seconds:.0f} s)", file=sys.stderr)
    return {"mode": "reference", "seq_len": seq_len, "batch_size": batch, "precision": "32-true",
            "optimizer": "AdamW", "data": data_desc, "results": rows}


# -- report ----------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    if result["mode"] == "reference":
        lines = ["| main + prophet | prophet windows / seq | torch.compile | s / step (median) | tokens/s | "
                 "best step tokens/s | reference tokens/s | ours / reference |", "|---|---|---|---|---|---|---|---|"]
        for r in result["results"]:
            windows = f"{r['prophet_windows']} (all)" if r["windows_per_seq"] is None else str(r["prophet_windows"])
            compiled = f"yes ({r['warmup_seconds']:.0f} s once)" if r.get("compiled") else "no"
            lines.append(f"| {r['size']} | {windows} | {compiled} | {r['seconds_per_step']:.2f} | "
                         f"{r['tokens_per_second']:,.0f} | "
                         f"{r['best_step_tokens_per_second']:,.0f} | {r['reference_tokens_per_second']:,.0f} | "
                         f"{r['vs_reference']:.2f}x |")
        seed = [r for r in result["results"] if r["size"] == "512x10+512x2" and r["windows_per_seq"] is None]
        if seed:
            hours = 1000 * 4 * seed[0]["seconds_per_step"] / 3600
            lines.append(f"\nexperiment=enwik8_prophet (512x10+512x2, batch 4 x grad-accum 4): about {hours:.1f} h "
                         f"per 1,000 optimizer steps at this rate.")
        return "\n".join(lines) + load_note(result)
    lines = [f"model={result['model']}, seq {result['seq_len']}, batch {result['batch_size']}, {result['rounds']} rounds "
             f"x {result['steps_per_round']} steps each side after {result['warmup_steps']} warm-up steps; "
             f"data: {result['data']}", "",
             "| precision | pipeline tokens/s | plain loop tokens/s | pipeline / plain (total time) | "
             "median of rounds | median step |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['precision']} | {r['pipeline_tokens_per_second']:,.0f} | {r['plain_tokens_per_second']:,.0f} | "
                     f"{r['ratio']:.3f} | {r['ratio_median_round']:.3f} | {r['ratio_median_step']:.3f} |")
    ev = result.get("speculative_eval")
    if ev:
        s = ev["settings"]
        lines.append("")
        lines.append(f"Speculative-decoding evaluation (not in the ratio): {ev['seconds']:.1f} s per validation "
                     f"({s['num_prompts']} prompts x {s['max_new_tokens']} tokens, gamma {s['gamma']}, temperatures "
                     f"{s['temperatures']}); every {ev['val_check_interval']} steps that is "
                     f"{100 * ev['share_of_training_time']:.1f}% of training time.")
    return "\n".join(lines) + load_note(result)


def load_note(result: dict) -> str:
    m = result["machine"]
    return (f"\n\n{m['cpus']} CPUs, {m['threads']} threads; load average (1 min) {m['load_average_1m_before']:.2f} "
            f"before, {m['load_average_1m_after']:.2f} after (well above 0 means other jobs shared the CPUs).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data", help=f"byte file (.gz, .zip or raw); default {DEFAULT_DATA} if present, "
                                       "else synthetic bytes")
    parser.add_argument("--reference", action="store_true", help="our train step vs the reference implementation")
    parser.add_argument("--model", default="mid", help="conf/model group of the pipeline run (default: mid)")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--warmup", type=int, default=2, help="pipeline steps before timing (plain too)")
    parser.add_argument("--steps", type=int, default=4, help="steps per round, each side")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, each side")
    parser.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides of the pipeline run")
    parser.add_argument("--windows-per-seq", type=int, nargs="*", default=[],
                        help="--reference: also measure with K random prophet windows per sequence")
    parser.add_argument("--sizes", nargs="*", choices=list(REFERENCE_SIZES), help="--reference: only these sizes")
    parser.add_argument("--compile", action="store_true", help="--reference: torch.compile the model (as compile=true)")
    parser.add_argument("--ref-steps", type=int, help="--reference: timed steps per size (default 12 / 5)")
    parser.add_argument("--out", help="JSON output (default bench/train.json, or bench/train_reference.json)")
    args = parser.parse_args(argv)
    if min(args.warmup, args.steps, args.rounds) < 1:
        parser.error("--warmup, --steps and --rounds must be >= 1")

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        started = time.perf_counter()
        try:
            result = bench_reference(args, Path(tmp)) if args.reference else bench_pipeline(args, Path(tmp))
        except SpecdecError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        result["wall_seconds"] = time.perf_counter() - started
    # other jobs on the machine skew every figure (the ratios less, being interleaved): keep the load
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "threads": torch.get_num_threads(), "load_average_1m_before": load_before[0],
                         "load_average_1m_after": os.getloadavg()[0]}
    result["command"] = " ".join(["python", "scripts/bench_train.py", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out) if args.out else REPO / "bench" / ("train_reference.json" if args.reference else "train.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(markdown(result))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
