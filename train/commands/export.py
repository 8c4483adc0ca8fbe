"""Export a training checkpoint for decoding: `specdec export CKPT OUT_DIR [--force]`.

Writes the same export as the end of `python -m train` (safetensors + JSON config, no pickle),
through `train.checkpoints.export_checkpoint`; `specdec_models.load_export(OUT_DIR)` and
`specdec decode --export OUT_DIR` load it. OUT_DIR must be new, empty or an
export of the same model (which it replaces, and says so); `--force` writes into any folder but
one that is, holds or lies inside the checkpoint or a --set path (`files.check_not_input`).

A checkpoint made on another machine (a GPU box) records that machine's paths: `--set
target_path=FILE` (repeatable, KEY=VALUE) replaces a text setting the checkpoint holds before the
model is built, e.g. a Hugging Face head's target model. The target's weights are still checked
against the hash the checkpoint recorded.
"""

from __future__ import annotations

import sys

from specdec_models.cli_args import Parser
from specdec_models.errors import cli_main, prog


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=prog("specdec export"), description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a Lightning checkpoint of any task (e.g. outputs/<run>/checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the export directory to write")
    parser.add_argument("--force", action="store_true",
                        help="write even into a folder that is not an export, or over an export of another model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="paths",
                        help="replace a text setting the checkpoint recorded, e.g. target_path=FILE for a checkpoint "
                             "made on another machine (repeatable)")
    args = parser.parse_args(argv)
    paths = {}
    for item in args.paths:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        paths[key] = value
    from specdec_models.files import check_not_input
    from train.checkpoints import export_checkpoint  # imports lightning: after argument parsing

    check_not_input(args.out_dir, [args.ckpt, *paths.values()], "OUT_DIR")
    path = export_checkpoint(args.ckpt, args.out_dir, force=args.force, paths=paths)
    print(f"export: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
