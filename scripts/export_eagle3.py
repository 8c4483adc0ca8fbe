"""Write an EAGLE-3 head in another layout: `python scripts/export_eagle3.py HEAD_DIR OUT_DIR --layout L`.

HEAD_DIR holds an eagle3 head in any layout (specdec's hf_eagle3 export, vLLM's speculators
format, SGLang's; `specdec_models.export.eagle3`); it is loaded for the target (`--hf-model DIR`
or `--gguf FILE`; default: the target a specdec export records) and written to OUT_DIR as
`--layout specdec | speculators | sglang` (`train.eagle3_export.export_head`, which the recipe
calls too). OUT_DIR must be new, empty, or hold the same layout's head of the same model; `--force`
replaces any folder but the head's own or the target's (or one holding them). Bad input: one line,
exit status 2, nothing written.

    python scripts/export_eagle3.py outputs/run/export serve/eagle3-vllm --layout speculators \\
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --verifier HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import sys

from specdec_models.errors import check, cli_main


@cli_main
def main(argv: list[str] | None = None) -> int:
    from train.eagle3_export import LAYOUTS, ExportJob, export_head

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("head", help="the eagle3 head to read (any layout)")
    parser.add_argument("out_dir", help="the directory to write")
    parser.add_argument("--layout", required=True, choices=LAYOUTS)
    parser.add_argument("--hf-model", metavar="DIR", help="the target: a local save_pretrained directory")
    parser.add_argument("--gguf", metavar="FILE", help="the target: a GGUF file")
    parser.add_argument("--verifier", help="speculators layout: the verifier's name or path to record "
                                           "(default: where the target was loaded from)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR whatever it holds")
    args = parser.parse_args(argv)
    check(not (args.hf_model and args.gguf), "give one target, not --hf-model and --gguf")
    path = export_head(ExportJob(args.head, args.out_dir, args.layout, args.hf_model or args.gguf, args.verifier,
                                 args.force))
    print(f"{args.layout}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
