"""`specdec VERB ...`: every journey's command under one name (pyproject's console script).

    specdec plan --target DIR|FILE.gguf|config.json --device cuda --gpu-memory 80GiB --gpus 8
    specdec eagle3 --target DIR --data sharegpt --out OUT
    specdec train experiment=enwik8_prophet
    specdec bench decode --methods base,prophet
    specdec VERB --help

Each verb is a command module's `main(argv)` (train/commands/, `specdec decode`'s,
`train.plan`'s), run in this process with its own arguments and its own help under the name
`specdec VERB`; `train` is `python -m train`'s Hydra entry (its overrides passed through, in a
process of its own); `bench` is a verb of verbs, the developer tools that time and compare
(`specdec bench NAME ...`). An unknown verb is one line, exit 2. sys.argv is left as it is:
Lightning's DDP launcher restarts a run from it.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple


class Verb(NamedTuple):
    """A verb: where its main is ("module:DOTTED", "hydra" or "bench", the verb of verbs) and its
    line in `specdec --help`."""

    where: str
    summary: str


VERBS = {     # the journey's verbs (issue 70)
    "plan": Verb("module:train.plan", "print the sizes the EAGLE-3 recipe will use for a target on a device, and why"),
    "eagle3": Verb("module:train.commands.eagle3", "the EAGLE-3 recipe: data, answers, cache, draft vocabulary, "
                                                   "training, export, evaluation"),
    "evaluate": Verb("module:train.commands.evaluate", "score EAGLE-3 heads and prompt lookup on MT-Bench and "
                                                       "HumanEval (tau, speed-up)"),
    "decode": Verb("module:specdec_models.decode.__main__", "generate text with plain or speculative decoding"),
    "export": Verb("module:train.commands.export", "export a training checkpoint for decoding"),
    "cache": Verb("module:train.commands.cache_embeddings", "cache a frozen model's hidden states for training a "
                                                            "head"),
    "draft-vocab": Verb("module:train.commands.draft_vocab", "count a target's greedy tokens on a cache and measure "
                                                             "draft vocabularies"),
    "train": Verb("hydra", "train with Hydra overrides, as `python -m train` (e.g. experiment=enwik8_prophet)"),
}

TOOLS = {     # the other commands: listed after the journey's verbs in `specdec --help`
    "export-head": Verb("module:train.commands.export_head", "write a trained head (EAGLE-3, DFlash, P-EAGLE) in "
                                                             "another layout (vLLM's speculators, SGLang, specdec's)"),
    "export-eagle3": Verb("module:train.commands.export_head", "export-head's first name, for EAGLE-3 heads"),
    "prompts": Verb("module:train.commands.make_prompts", "make single-turn prompts from a text file"),
    "peers": Verb("module:train.commands.train_peers", "train speculators' and SpecForge's heads on a specdec cache "
                                                       "(make setup-interop)"),
    "plot": Verb("module:train.commands.plot_runs", "plot the metrics of training runs"),
    "scale-plan": Verb("module:train.commands.scale_plan", "the estimates of docs/scale.md for targets' config.json"),
    "bench": Verb("bench", "the developer tools that time and compare (specdec bench --help)"),
}

BENCH = {     # `specdec bench NAME`: the developer tools, each a module of train/commands
    "answers": Verb("module:train.commands.bench_answers", "time the answering engine against a serving engine"),
    "decode": Verb("module:train.commands.bench_decode", "time plain and speculative decoding of specdec exports"),
    "decode-rev": Verb("module:train.commands.bench_decode_rev", "time a head's decoding loop against a git "
                                                                 "revision's"),
    "train": Verb("module:train.commands.bench_train", "time training steps and pipelines"),
    "hf": Verb("module:train.commands.bench_hf", "time a Hugging Face target's decoding and verify calls"),
    "cpu": Verb("module:train.commands.bench_cpu", "time the CPU paths (few-row matmuls, decoding end to end)"),
    "acceptance": Verb("module:train.commands.acceptance", "acceptance of prophet exports on enwik8"),
    "compare-drafts": Verb("module:train.commands.compare_drafts", "compare draft-distillation divergences and data"),
    "compare-hf": Verb("module:train.commands.compare_hf", "compare with transformers' assisted generation"),
    "compare-hf-drafts": Verb("module:train.commands.compare_hf_drafts", "make students, corpora, datastores; "
                                                                         "compare Hugging Face drafters"),
}


def usage(verbs: dict[str, Verb], name: str) -> str:
    """`specdec --help` (or `specdec bench --help`): the verbs, one line each (`specdec`'s: the
    journey's verbs, then the tools)."""
    width = max(map(len, verbs))
    lines = [f"usage: {name} VERB [ARGS ...]   ({name} VERB --help: the verb's own options)", "", "verbs:"]
    for verb, v in verbs.items():
        if verb == next(iter(TOOLS)) and verbs is not BENCH:
            lines += ["", "tools:"]
        lines.append(f"  {verb:<{width}}  {v.summary}")
    return "\n".join(lines)


def load_main(where: str) -> Callable[..., int | None]:
    """The `main` a verb runs, from its module."""
    return importlib.import_module(where.partition(":")[2]).main


# `python -m train`'s own flags (Hydra's); anything else starting with "-" is a typo, not an override
HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "--resolve", "-p", "--package", "-r",
               "--run", "-m", "--multirun", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
               "--config-name", "-cd", "--config-dir", "--experimental-rerun", "-i", "--info")


def run_train(args: list[str]) -> int:
    """`python -m train ARGS` as a process of its own: Hydra reads its overrides from the command
    line, and Lightning's DDP launcher restarts that command line for each process."""
    unknown = [a for a in args if a.startswith("-") and a.partition("=")[0] not in HYDRA_FLAGS]
    if unknown:
        print(f"error: specdec train: unknown flag {unknown[0]!r}: give Hydra overrides as KEY=VALUE "
              f"(e.g. experiment=enwik8_prophet) or one of Hydra's flags (specdec train --help)", file=sys.stderr)
        return 2
    if "--help" in args or "-h" in args:
        print("specdec train [OVERRIDE ...]: `python -m train` under another name; Hydra's help follows", flush=True)
    return subprocess.run([sys.executable, "-m", "train", *args], check=False).returncode


def run_verb(verbs: dict[str, Verb], name: str, argv: list[str]) -> int:
    """`NAME VERB ARGS...` (NAME: "specdec" or "specdec bench"): the verb's exit status (an argparse
    --help's 0 included); an unknown or missing verb is one line, exit 2."""
    from specdec_models.errors import command_name

    if argv[:1] in (["-h"], ["--help"]):
        print(usage(verbs, name))
        return 0
    if not argv or argv[0] not in verbs:
        said = f"unknown verb {argv[0]!r}" if argv else "no verb"
        print(f"error: {said}: choose from {', '.join(verbs)} ({name} --help)", file=sys.stderr)
        return 2
    verb, rest = argv[0], argv[1:]
    if verbs[verb].where == "hydra":
        return run_train(rest)
    if verbs[verb].where == "bench":
        return run_verb(BENCH, f"{name} {verb}", rest)
    try:
        with command_name(f"{name} {verb}"):          # the verb's usage line names it so
            code = load_main(verbs[verb].where)(rest)
    except SystemExit as stop:                        # argparse's --help
        code = stop.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    return 0 if code is None else int(code)


def main(argv: list[str] | None = None) -> int:
    """`specdec VERB ARGS...`: the verb's exit status."""
    return run_verb(VERBS | TOOLS, "specdec", sys.argv[1:] if argv is None else [str(a) for a in argv])


if __name__ == "__main__":
    sys.exit(main())
