"""`specdec VERB ...`: every journey's command under one name (pyproject's console script).

    specdec plan --target DIR|FILE.gguf|config.json --device cuda --gpu-memory 80GiB --gpus 8
    specdec eagle3 --target DIR --data sharegpt --out OUT
    specdec train experiment=enwik8_prophet
    specdec VERB --help

Each verb is an existing command, run in this process with its own arguments and its own help
under the name `specdec VERB`: the scripts' `main` (scripts/eagle3.py, evaluate.py, export.py,
cache_embeddings.py, draft_vocab.py, loaded by path as the tests load them, so the scripts stay
where other tools call them), `python -m specdec_models.decode`'s, `python -m train`'s Hydra entry
(its overrides passed through, in a process of its own) and `train.plan`'s. An unknown verb is one
line, exit 2. sys.argv is left as it is: Lightning's DDP launcher restarts a run from it.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


class Verb(NamedTuple):
    """A verb: where its main is ("script:NAME" under scripts/, "module:DOTTED", or "hydra") and
    its line in `specdec --help`."""

    where: str
    summary: str


VERBS = {
    "plan": Verb("module:train.plan", "print the sizes the EAGLE-3 recipe will use for a target on a device, and why"),
    "eagle3": Verb("script:eagle3", "the EAGLE-3 recipe: data, answers, cache, draft vocabulary, training, export, "
                                    "evaluation"),
    "evaluate": Verb("script:evaluate", "score EAGLE-3 heads and prompt lookup on MT-Bench and HumanEval (tau, "
                                        "speed-up)"),
    "decode": Verb("module:specdec_models.decode.__main__", "generate text with plain or speculative decoding"),
    "export": Verb("script:export", "export a training checkpoint for decoding"),
    "cache": Verb("script:cache_embeddings", "cache a frozen model's hidden states for training a head"),
    "draft-vocab": Verb("script:draft_vocab", "count a target's greedy tokens on a cache and measure draft "
                                              "vocabularies"),
    "train": Verb("hydra", "train with Hydra overrides, as `python -m train` (e.g. experiment=enwik8_prophet)"),
}


def usage() -> str:
    """`specdec --help`: the verbs, one line each."""
    width = max(map(len, VERBS))
    lines = ["usage: specdec VERB [ARGS ...]   (specdec VERB --help: the verb's own options)", "", "verbs:"]
    lines += [f"  {name:<{width}}  {verb.summary}" for name, verb in VERBS.items()]
    return "\n".join(lines)


def load_main(where: str) -> Callable[..., int | None]:
    """The `main` a verb runs: a script's (loaded from its file) or a module's."""
    kind, _, name = where.partition(":")
    if kind == "module":
        return importlib.import_module(name).main
    path = SCRIPTS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"specdec_verb_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def run_train(args: list[str]) -> int:
    """`python -m train ARGS` as a process of its own: Hydra reads its overrides from the command
    line, and Lightning's DDP launcher restarts that command line for each process."""
    if "--help" in args or "-h" in args:
        print("specdec train [OVERRIDE ...]: `python -m train` under another name; Hydra's help follows", flush=True)
    return subprocess.run([sys.executable, "-m", "train", *args], check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """`specdec VERB ARGS...`: the verb's exit status (an argparse --help's 0 included)."""
    from specdec_models.errors import command_name

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in VERBS:
        said = f"unknown verb {argv[0]!r}" if argv else "no verb"
        print(f"error: {said}: choose from {', '.join(VERBS)} (specdec --help)", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if VERBS[name].where == "hydra":
        return run_train(rest)
    try:
        with command_name(f"specdec {name}"):        # the verb's usage line names it so
            code = load_main(VERBS[name].where)(rest)
    except SystemExit as stop:                       # argparse's --help and usage errors
        code = stop.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            code = 1
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
