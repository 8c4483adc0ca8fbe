"""This checkout's decoding loop against an earlier revision's, side by side in one process:

    specdec bench decode-rev --target SmolLM2.gguf --head outputs/eagle3/eagle3/export --base main

Batch 1, T=0, fp32, the first --prompts MT-Bench questions, each decoded by both loops in turn
(`train.bench.decode_rev`), as a chain of --gamma and as the --tree; prints tokens/s of each loop
and the ratio this/base per method, the last line `ratio chain X.XXX tree Y.YYY`.
"""

from __future__ import annotations

import json
import sys

from specdec_models.cli_args import Parser
from specdec_models.decode.tree import add_tree_argument
from specdec_models.errors import check, cli_main, prog


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog=prog("specdec bench decode-rev"), description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="a GGUF file or a Hugging Face model directory")
    p.add_argument("--head", required=True, help="an EAGLE-3 head export for the target (any layout)")
    p.add_argument("--base", required=True, help="the git revision whose loop is the baseline")
    p.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns decoded (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per answer (default %(default)s)")
    add_tree_argument(p, "the tree (default 6,3,1,0.1)", default="6,3,1,0.1")
    p.add_argument("--gamma", type=int, default=5, help="the chain's drafted tokens per round (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    check(a.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    from train.bench.decode_rev import bench

    result = bench(a.target, a.head, a.base, prompts=a.prompts, max_new_tokens=a.max_new_tokens, tree=a.tree,
                   gamma=a.gamma, threads=a.threads, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1))
    print(f"ratio chain {result['chain']['ratio']:.3f} tree {result['tree']['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
