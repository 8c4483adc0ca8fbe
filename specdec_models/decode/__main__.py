"""The decoding CLI: `specdec decode --export DIR --prompt TEXT`.

Loads an export (see `specdec_models.export`), encodes the prompt with the export's tokenizer
(kind "bytes": the UTF-8 bytes, token id = byte value), runs `generate` with the chosen method
and prints each row's continuation and the decoding stats (docs/DECODING.md defines them), or one JSON
object with `--json`. Methods: `base` (one target call per token), `draft` (a second export
drafts, `--draft DIR`), `prophet` (a model_with_prophet export drafts with its own prophet),
`lookup` (`--lookup N[..MAX]`: prompt lookup, no draft model; `--datastore FILE` adds a datastore's
continuations, `decode.lookup`).
Every bad input is one line `error: ...` on stderr and exit status 2. `--device` (cpu by default,
cuda, cuda:N, mps, or auto: cuda when here, else cpu, said on stderr; one that is not here is
refused) is where the models decode, prepared for it by
`specdec_models.cpu.prepare_for_device` (on a CPU: few-row linear layers where they pay).

A Hugging Face target instead: `--hf-model DIR` (a local `save_pretrained` directory) or
`--gguf FILE`, its tokenizer from the same place, the prompt encoded by it (`--chat`: as one user
turn of its chat template), rows stopping at its EOS token unless `--ignore-eos`; `--draft` is
then a Hugging Face draft (a directory or a GGUF file, sharing the tokenizer) and `--prophet DIR`
an `hf_prophet` export trained for this target (alone, it names its target by the path it records),
and `--eagle3 DIR` an EAGLE-3 head for this target in any layout: specdec's hf_eagle3 export, vLLM's
speculators format or SGLang's (`specdec_models.export.eagle3`), e.g. one trained by another tool.

    specdec decode --export outputs/run/export --prompt "The quick brown fox" \
        --gamma 5 --temperature 0.8 --top-p 0.95 --max-new-tokens 200 --batch 4 --json
    specdec decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prophet HEAD_DIR \
        --chat --prompt "What is the capital of France?" --temperature 0 --gamma 4
    specdec decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --eagle3 SPECULATORS_DIR \
        --chat --prompt "What is the capital of France?" --temperature 0 --gamma 4 --json
    specdec decode --gguf SmolLM2-135M-Instruct.Q4_1.gguf --lookup 4..16 \
        --chat --prompt "Repeat after me: the cat sat on the mat." --temperature 0
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from .. import byte_tokenizer
from ..cli_args import Parser
from ..cpu import add_dtype_argument, prepare_for_device, resolve_device, resolve_dtype
from ..device import HELP, pick_device
from ..errors import SpecdecError, check, prog
from ..export import encode_prompt, load_export, load_hf_run, read_export_config
from ..heads import ModelWithProphet
from ..hf import HFDecoder
from ..sampling import SamplingConfig
from . import generate
from .cost import stored_profile
from .datastore import Datastore
from .drafters import Drafter, DraftModel, HeadDrafter, Lookup, TreeDrafter
from .inputs import parse_gamma
from .lookup import parse_lookup
from .speculative import VERIFY
from .tree import TreeSpec, add_tree_argument

METHODS = ("base", "draft", "prophet", "eagle3", "lookup")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=prog("specdec decode"),
                     description="Generate text from a specdec export or a Hugging Face model with plain or "
                                 "speculative decoding.")
    parser.add_argument("--export", metavar="DIR",
                        help="the target's export directory (a decoder or a model_with_prophet)")
    parser.add_argument("--hf-model", metavar="DIR", help="a Hugging Face target: a local save_pretrained directory")
    parser.add_argument("--gguf", metavar="FILE", help="a Hugging Face target from a GGUF file")
    parser.add_argument("--prompt", required=True,
                        help="prompt text: UTF-8 bytes for an export, the target's tokenizer for a Hugging Face model")
    parser.add_argument("--chat", action="store_true", help="Hugging Face target: wrap the prompt in its chat template")
    parser.add_argument("--draft", metavar="DIR",
                        help="the draft for --method draft: an export (a decoder, or a model_with_prophet whose "
                             "main model drafts), or with a Hugging Face target a model directory or GGUF file")
    parser.add_argument("--prophet", metavar="DIR", help="Hugging Face target: an hf_prophet export (a head trained "
                                                         "for it) drafts")
    parser.add_argument("--eagle3", metavar="DIR",
                        help="Hugging Face target: an EAGLE-3 head for it (specdec hf_eagle3 export, speculators or "
                             "SGLang layout)")
    add_tree_argument(parser, "with --eagle3: draft a tree instead of a chain (gamma is then unused)")
    parser.add_argument("--lookup", metavar="N[..MAX]", default=None,
                        help="prompt-lookup decoding (method lookup, no draft model): N tokens that followed the "
                             "context's last n-gram earlier in it, verified in one call per round; N..MAX doubles "
                             "after each fully accepted lookup, up to MAX (e.g. 4..16)")
    parser.add_argument("--datastore", metavar="FILE",
                        help="with --lookup, or --tree and its lookup: a datastore of the target's own answers "
                             "(scripts/"
                             "compare_hf_drafts.py datastore): where it matches a longer n-gram than prompt lookup "
                             "does in the context, its continuation is the tree's looked-up path")
    parser.add_argument("--method", choices=METHODS,
                        help="default: draft with --draft, prophet with --prophet or a model_with_prophet export, "
                             "else base")
    parser.add_argument("--gamma", type=parse_gamma, default=5,
                        help="tokens drafted per round (default 5), or auto: the gamma with the best predicted "
                             "speed-up, from the export's metadata speed_profile or measured on the first tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    parser.add_argument("--verify", choices=VERIFY, default="block",
                        help="how a sampled draft chain is accepted: block (default; decode/block.py: lossless, "
                             "never fewer tokens per round) or token by token")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample from the K most probable tokens only (default: all)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="sample from the smallest set of tokens whose probability reaches P (default: all)")
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="divide the logits (> 0; multiply those < 0) of ids already in the context (1 = none)")
    parser.add_argument("--max-new-tokens", type=int, default=200,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="decode the prompt N times as one batch")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    parser.add_argument("--eos-id", type=int, default=None,
                        help="stop a row after this token (Hugging Face target: default its tokenizer's EOS)")
    parser.add_argument("--ignore-eos", action="store_true", help="Hugging Face target: do not stop at EOS")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--device", default="cpu",
                        help=f"where the models decode: cpu (default), cuda, cuda:N or mps, or auto ({HELP}, on "
                             "stderr); on a CPU the linear layers are tuned for it (specdec_models/cpu)")
    add_dtype_argument(parser, what="Hugging Face target: the dtype of the target and its draft or head (greedy "
                                    "output is exactly transformers' in fp32)")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result = run(args)
    except SpecdecError as error:
        message = " ".join(str(error).split())
        print(f"error: {message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        print(format_text(result))
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Check the arguments, load the models, decode; return the JSON result."""
    # settings first, so a typo is reported before any model is loaded
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    check(args.gamma == "auto" or args.gamma >= 1, f"--gamma must be >= 1 or auto, got {args.gamma}")
    check(args.max_new_tokens >= 0, f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    check(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    check(args.eos_id is None or args.eos_id >= 0, f"--eos-id must be a token id >= 0, got {args.eos_id}")
    check(len(args.prompt) > 0, "--prompt is empty: give at least one character")
    # one that is not here: refused before any loading; auto said on stderr (stdout is the text)
    args.device = resolve_device(pick_device(args.device, sys.stderr), "--device")
    args.tree = TreeSpec.parse(args.tree) if args.tree else None      # checked by the parser, before any loading
    if args.tree is not None:
        check(args.eagle3, "--tree drafts with an EAGLE-3 head: give --eagle3 DIR")
    if args.lookup is not None:
        args.lookup = parse_lookup(args.lookup)
    check(args.method != "lookup" or args.lookup is not None, "--method lookup needs --lookup N[..MAX]")
    check(args.lookup is None or (args.method or "lookup") == "lookup",
          f"--lookup is only used by --method lookup, not --method {args.method}")
    for flag, value in (("--draft", args.draft), ("--prophet", args.prophet), ("--eagle3", args.eagle3)):
        check(args.lookup is None or value is None,
              f"give --lookup or {flag}, not both: prompt lookup needs no drafter")
    if args.datastore is not None:
        check(args.lookup is not None or (args.tree is not None and args.tree.lookup > 0),
              "--datastore proposes a looked-up path: give --lookup N, or --tree with a lookup (e.g. 8,4,3,4..16,0.2)")
        args.datastore = Datastore.load(args.datastore)
    given = [flag for flag, value in (("--export", args.export), ("--hf-model", args.hf_model), ("--gguf", args.gguf))
             if value is not None]
    check(len(given) <= 1, f"give one target, not {' and '.join(given)}")
    if args.hf_model or args.gguf or ((args.prophet or args.eagle3) and not args.export):
        return run_hf(args, sampling)
    check(args.export is not None, "give the target: --export DIR (a specdec export), --hf-model DIR or --gguf FILE")
    for flag, value in (("--prophet", args.prophet), ("--eagle3", args.eagle3), ("--chat", args.chat),
                        ("--ignore-eos", args.ignore_eos)):
        check(not value, f"{flag} is for a Hugging Face target (--hf-model DIR or --gguf FILE), not --export")

    exported = load_export(args.export)
    target = exported.model if isinstance(exported, ModelWithProphet) else exported
    method = args.method or ("draft" if args.draft else "lookup" if args.lookup else
                             "prophet" if isinstance(exported, ModelWithProphet) else "base")
    check(method != "eagle3", "--method eagle3 is for a Hugging Face target (--hf-model DIR or --gguf FILE with "
                              "--eagle3 DIR), not --export")
    draft = prophet = None
    if method == "draft":
        check(args.draft is not None, "--method draft needs --draft DIR, the draft model's export")
        draft = load_export(args.draft)
        draft = draft.model if isinstance(draft, ModelWithProphet) else draft
        check(draft.vocab_size == target.vocab_size,
              f"the draft's vocabulary ({draft.vocab_size} tokens, {args.draft}) differs from the target's "
              f"({target.vocab_size} tokens, {args.export}): use a draft trained on the same tokenizer")
    else:
        check(args.draft is None, f"--draft is only used by --method draft, not --method {method}")
    if method == "prophet":
        check(isinstance(exported, ModelWithProphet),
              f"--method prophet needs a model_with_prophet export, {args.export} holds a plain decoder: "
              f"use --method base or --method draft --draft DIR")
        prophet = exported

    prepare_for_device([exported, draft], args.device, dtype=None)     # an export decodes in its own dtype
    prompt = byte_tokenizer.encode(args.prompt, target.vocab_size, target.cfg.max_seq_len)[None].to(args.device)
    profile = None
    if args.gamma == "auto" and method != "base":
        # a profile stored with the export (per-position acceptance, c and v measured in training's evaluation)
        metadata = read_export_config(args.draft if method == "draft" else args.export).get("metadata", {})
        profile = stored_profile(metadata, sampling.temperature, args.batch)
    drafter = _drafter(draft, prophet, lookup=args.lookup, datastore=args.datastore)
    tokens, stats = generate(target, prompt.expand(args.batch, -1), args.max_new_tokens, drafter,
                             sampling=sampling, gamma=args.gamma, speed_profile=profile, eos_id=args.eos_id,
                             verify=args.verify, generator=_generator(args))
    continuations = [byte_tokenizer.decode(t) for t in tokens]
    return {"method": method, "continuations": continuations, "stats": stats.to_dict()}


def run_hf(args: argparse.Namespace, sampling: SamplingConfig) -> dict[str, Any]:
    """The Hugging Face target's run: load and check the models (`export.load.load_hf_run`), decode."""

    method = args.method or ("draft" if args.draft else "prophet" if args.prophet else "eagle3" if args.eagle3
                             else "lookup" if args.lookup else "base")
    check(method != "draft" or args.draft is not None, "--method draft needs --draft (a Hugging Face model directory "
                                                       "or GGUF file sharing the target's tokenizer)")
    check(method != "prophet" or args.prophet is not None,
          "--method prophet with a Hugging Face target needs --prophet DIR (an hf_prophet export)")
    check(method != "eagle3" or args.eagle3 is not None,
          "--method eagle3 needs --eagle3 DIR (an eagle3 head: specdec, speculators or SGLang layout)")
    for flag, value, used_by in (("--draft", args.draft, "draft"), ("--prophet", args.prophet, "prophet"),
                                 ("--eagle3", args.eagle3, "eagle3")):
        check(value is None or method == used_by, f"{flag} is only used by --method {used_by}, not --method {method}")
    check(not (args.ignore_eos and args.eos_id is not None), "give --eos-id or --ignore-eos, not both")
    _quiet_transformers()
    dtype = resolve_dtype(args.dtype, args.device)
    hf = load_hf_run(args.hf_model or args.gguf, args.draft, args.prophet, eagle3=args.eagle3, dtype=dtype)
    prepare_for_device([hf.target, hf.draft, hf.prophet], args.device, dtype)
    if args.datastore is not None and "vocabulary_sha256" in args.datastore.source:
        from ..hf.weights import vocabulary_fingerprint

        check(args.datastore.source["vocabulary_sha256"] == vocabulary_fingerprint(hf.tokenizer),
              "--datastore holds answers in another tokenizer than the target's: write it from this target's cache")
    max_len = HFDecoder(hf.target).cfg.max_seq_len
    prompt = encode_prompt(hf.tokenizer, args.prompt, args.chat, hf.vocab_size, max_len).to(args.device)
    eos = args.eos_id if args.eos_id is not None or args.ignore_eos else hf.tokenizer.eos_token_id
    check(eos is None or 0 <= eos < hf.vocab_size, f"--eos-id must be a token id in [0, {hf.vocab_size}), got {eos}")
    tokens, stats = generate(hf.target, prompt.expand(args.batch, -1), args.max_new_tokens,
                             _drafter(hf.draft, hf.prophet, args.tree, args.lookup, args.datastore), sampling=sampling,
                             gamma=args.gamma, eos_id=eos, vocab_size=hf.vocab_size, verify=args.verify,
                             generator=_generator(args))
    continuations = [hf.tokenizer.decode(t.tolist(), skip_special_tokens=True) for t in tokens]
    return {"method": method, "continuations": continuations, "stats": stats.to_dict()}


def _drafter(draft: Any = None, head: Any = None, tree: TreeSpec | None = None, lookup: tuple[int, int] | None = None,
             datastore: Datastore | None = None) -> Drafter | None:
    """The drafter the loaded models make: a draft model, a head's tree (with its datastore),
    prompt lookup (with its datastore) or a head's chain, or None (plain decoding)."""
    if draft is not None:
        return DraftModel(draft)
    if lookup is not None:
        return Lookup(*lookup, datastore=datastore)
    if tree is not None:
        return TreeDrafter(head, tree, datastore)
    return None if head is None else HeadDrafter(head)


def _generator(args: argparse.Namespace) -> torch.Generator | None:
    """The sampling generator of --seed, on the decoding's device (None without --seed)."""
    return None if args.seed is None else torch.Generator(device=args.device).manual_seed(args.seed)


def _quiet_transformers() -> None:
    """No progress bars or warnings from transformers on stderr: the CLI prints one result."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def _printable(text: str) -> str:
    # a random or half-trained model emits control bytes; escape them so they cannot drive the terminal
    return "".join(c if c in "\n\t" or c.isprintable() else repr(c)[1:-1] for c in text)


def format_text(result: dict[str, Any]) -> str:
    rows = result["continuations"]
    lines = []
    for i, text in enumerate(rows):
        if len(rows) > 1:
            lines.append(f"--- row {i}")
        lines.append(_printable(text))
    s = result["stats"]
    summary = (f"--- {result['method']}: {s['new_tokens']} new tokens in {s['wall_seconds']:.2f} s "
               f"({s['tokens_per_second']:.1f} tokens/s), {s['target_calls']} target calls, "
               f"{s['tokens_per_call']:.2f} tokens per call")
    if s.get("acceptance_rate") is not None:
        alpha = "n/a" if s.get("alpha") is None else f"{s['alpha']:.3f}"
        per_position = " ".join(f"{a:.2f}" for a in s.get("per_position_acceptance", []))
        summary += (f", acceptance rate {s['acceptance_rate']:.3f} ({s['accepted']}/{s['drafted']}), "
                    f"alpha {alpha}, per position [{per_position}]")
    lines.append(summary)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
