"""`python -m train experiment=enwik8_prophet`: the Hydra shell around `train.run.run`.

Mistakes answer in one line on stderr with exit status 2, whether Hydra finds them (an unknown
key, a bad override, a missing config option) or the project does (`SpecdecError`);
HYDRA_FULL_ERROR=1 shows the traceback instead.
"""

import os
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from specdec_models.errors import SpecdecError

CONF = Path(__file__).resolve().parent.parent / "conf"   # absolute: found however this module is imported
MISTAKES = (SpecdecError, HydraException, OmegaConfBaseException)
USER_WANTS_TRACEBACK = os.environ.get("HYDRA_FULL_ERROR") == "1"


def message(error: BaseException) -> str:
    """The error and its cause in one line, without Hydra's search-path and key-type details."""
    parts = []
    for part in (error, error.__cause__):
        lines = []
        for line in str(part or "").splitlines():
            line = line.strip()
            if line.startswith("Config search path"):
                break
            if line and not line.startswith(("full_key:", "object_type=", "reference_type=")):
                lines.append(line)
        if lines and " ".join(lines) not in parts:
            parts.append(" ".join(lines))
    return ": ".join(parts) or type(error).__name__


def fail(error: BaseException) -> NoReturn:
    """Print `error: <one line>` and exit 2."""
    if USER_WANTS_TRACEBACK and not isinstance(error, SpecdecError):
        raise error
    print(f"error: {message(error)}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="train")
def main(cfg: DictConfig) -> None:
    if not USER_WANTS_TRACEBACK:
        os.environ.pop("HYDRA_FULL_ERROR", None)    # processes the run starts (DDP) see the user's setting
    from train.run import run   # imported here so `--help` and config errors skip importing lightning

    try:
        run(cfg)
    except MISTAKES as error:
        fail(error)


def cli() -> None:
    os.environ["HYDRA_FULL_ERROR"] = "1"      # Hydra raises its composition errors instead of printing them
    try:
        main()
    except MISTAKES as error:
        fail(error)


if __name__ == "__main__":
    cli()
