"""Write a trained head in another layout: `specdec export-head HEAD_DIR OUT_DIR --layout L`.

HEAD_DIR holds a head of any kind in any of its layouts (`specdec_models.export.heads`): EAGLE-3 in
specdec's hf_eagle3 export, vLLM's speculators format or SGLang's; DFlash and P-EAGLE in specdec's or
speculators'. It is loaded for the target (`--hf-model DIR` or `--gguf FILE`; default: the target
the head records) and written to OUT_DIR as `--layout specdec | speculators | sglang`
(`train.eagle3_export.export_head`, which the recipe calls too); a layout the kind has none of is
one line (SGLang's DFlash reads z-lab's own checkpoint layout, which specdec does not write; SGLang
has no P-EAGLE). The speculators layout records how many tokens vLLM should draft per step: give the
drafting you evaluated, `--speculative-tokens N` (a chain of gamma N) or `--tree SPEC` (its depth);
without either, specdec evaluate's default chain (an EAGLE-3 head's gamma 5, a block head's whole
block). The line printed says which, and the number to give vLLM (`num_speculative_tokens`) or SGLang
(`--speculative-num-steps`): docs/serving.md. OUT_DIR must be new, empty, or hold the same layout's
head of the same model; `--force` replaces any folder but the head's own or the target's (or one
holding them). Bad input: one line, exit status 2, nothing written. `specdec export-eagle3` is the
same command.

    specdec export-head outputs/run/export serve/eagle3-vllm --layout speculators \\
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --verifier HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import sys

from specdec_models.cli_args import Parser
from specdec_models.errors import check, cli_main, prog


@cli_main
def main(argv: list[str] | None = None) -> int:
    from specdec_models.decode.tree import add_tree_argument
    from train.eagle3_export import LAYOUTS, Drafting, ExportJob, export_head

    parser = Parser(prog=prog("specdec export-head"), description=__doc__.splitlines()[0])
    parser.add_argument("head", help="the head to read (eagle3, dflash or peagle, any layout)")
    parser.add_argument("out_dir", help="the directory to write")
    parser.add_argument("--layout", required=True, choices=LAYOUTS,
                        help="the layout written: specdec (specdec's own), speculators (vLLM's) or sglang")
    parser.add_argument("--hf-model", metavar="DIR", help="the target: a local save_pretrained directory")
    parser.add_argument("--gguf", metavar="FILE", help="the target: a GGUF file")
    parser.add_argument("--verifier", help="speculators layout: the verifier's name or path to record "
                                           "(default: where the target was loaded from)")
    drafting = parser.add_mutually_exclusive_group()
    drafting.add_argument("--speculative-tokens", type=int, metavar="N",
                          help="tokens drafted per step, as evaluated: a chain of gamma N (default: "
                               "specdec evaluate's default chain: gamma 5, a block head's whole block); written into "
                               "the speculators layout")
    add_tree_argument(drafting, "the tree the head was evaluated with: its depth is the tokens drafted per step")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR whatever it holds")
    args = parser.parse_args(argv)
    check(not (args.hf_model and args.gguf), "give one target, not --hf-model and --gguf")
    given = args.speculative_tokens is not None or bool(args.tree)
    plan = Drafting.of(args.speculative_tokens, tree=args.tree or None) if given else None
    done = export_head(ExportJob(args.head, args.out_dir, args.layout, args.hf_model or args.gguf, args.verifier,
                                 args.force, plan))
    print(f"{args.layout}: {done.path}")
    print(done.drafting.describe(args.layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
