"""Write instruction prompts as a chat file (one JSON object per line).

    specdec prompts --text ../shared/data/textmix100m.gz --count 2048 --out prompts.jsonl
    specdec prompts --text ../shared/data/textmix100m.gz --split valid --count 64 --out eval.jsonl
    specdec prompts --kind open --split valid --count 16 --out open_eval.jsonl

Each line is {"messages": [{"role": "user", "content": ...}]}: a template ("Explain the following
text in simple words:", "Summarize this in one or two sentences:", ...) around a snippet of the
text (`train.data.regenerate.prompts_from_text`), from its training or validation split (enwik8's
90/5/5 byte split), so prompts made for training and for evaluation never share a snippet.
`--kind open` writes open-ended instructions instead (a story, an explanation, a list of tips:
`train.data.prompts`, whose train and valid halves share no topic), `--kind mix` half of each.
The target continues them itself: specdec cache --prompts FILE --chat.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdec_models.cli_args import Parser
from specdec_models.errors import SpecdecError, cli_main, prog

MAX_COUNT = 1_000_000        # about a minute of snippets and 300 MB of prompts; the GPU recipe draws 40,000


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=prog("specdec prompts"), description=__doc__.splitlines()[0])
    parser.add_argument("--text", help="a text file (raw, .zip or .gz): needed by --kind text and mix")
    parser.add_argument("--kind", choices=("text", "open", "mix"), default="text",
                        help="text: instructions around snippets of --text; open: open-ended instructions (a story, an "
                             "explanation, a list of tips) from train/data/prompts.py; mix: half of each; default text")
    parser.add_argument("--split", choices=("train", "valid"), default="train", help="which split; default train")
    parser.add_argument("--count", type=int, required=True, help="number of prompts")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed (default %(default)s)")
    parser.add_argument("--out", required=True, help="the .jsonl file to write")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = parser.parse_args(argv)

    from specdec_models.errors import check, check_positive_int
    from specdec_models.files import check_output, os_error, write_file
    from train.data.enwik8 import ENWIK8_BYTES, read_bytes, split_bounds
    from train.data.prompts import open_prompts
    from train.data.regenerate import prompts_from_text

    out = Path(args.out).expanduser()
    check_positive_int(args.count, "--count")
    check(args.count <= MAX_COUNT, f"--count {args.count} is more than the {MAX_COUNT:,} prompts this script makes")
    check(not out.is_dir(), f"--out {args.out} is a directory: give the .jsonl file to write")
    check_output(args.out, "--out", force=args.force, inputs=[args.text])
    n_open = {"text": 0, "open": args.count, "mix": args.count // 2}[args.kind]
    prompts = open_prompts(n_open, args.split, args.seed) if n_open else []
    if n_open < args.count:
        check(args.text is not None, f"--kind {args.kind} needs --text FILE")
        if not Path(args.text).expanduser().is_file():
            raise SpecdecError(f"--text {args.text} does not exist")
        data = read_bytes(Path(args.text).expanduser())[:ENWIK8_BYTES]
        train_end, valid_end = split_bounds(len(data))[:2]
        part = data[:train_end] if args.split == "train" else data[train_end:valid_end]
        prompts += prompts_from_text(part.tobytes().decode("utf-8", errors="ignore"), args.count - n_open, args.seed)
    lines = "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file(out, lambda f: f.write(lines.encode("utf-8")))
    except OSError as error:
        raise os_error(error, f"cannot write {args.out}") from None
    source = "open-ended topics" if args.kind == "open" else args.text
    print(f"{len(prompts)} {args.kind} prompts from the {args.split} split of {source} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
