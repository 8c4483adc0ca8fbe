"""`python scripts/smollm2.py --gguf-path`: the path of SmolLM2-135M-Instruct's GGUF (`train.smollm2`).

A thin alias kept for the GPU recipe tool (`../shared/tools/gpu-recipe/prepare.sh` calls it);
`python -m train.smollm2` prints the same path. The text-prompt recipe that once lived here is
`scripts/eagle3.py --data text:FILE` (`make smollm2-text`).
"""

from __future__ import annotations

import sys

from specdec_models.cli_args import Parser
from specdec_models.errors import cli_main


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf-path", action="store_true", required=True, help="print the GGUF's path")
    p.parse_args(argv)
    from train.smollm2 import smollm2_gguf

    print(smollm2_gguf())
    return 0


if __name__ == "__main__":
    sys.exit(main())
