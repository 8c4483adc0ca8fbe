"""`specdec train experiment=enwik8_prophet`: the Hydra shell around `train.run.run`.

Mistakes answer in one line on stderr with exit status 2, whether Hydra finds them (an unknown
key, a bad override, a missing config option) or the project does (`SpecdecError`);
HYDRA_FULL_ERROR=1 shows the traceback instead.

`hydra.run.dir=X` is the run's output_dir (`train.run.output_dir`). Hydra creates X before the
run's checks; a run refused in one line removes it again when X (and the parents Hydra made for
it) did not exist before and is still empty.
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
RUN_DIR_ARG = "hydra.run.dir="
_existing: dict[Path, Path] = {}    # hydra.run.dir=X given: X resolved -> its nearest ancestor that existed before


def note_run_dir(argv: list[str]) -> None:
    """Remember which part of a `hydra.run.dir=X` argument existed before Hydra creates X."""
    for arg in argv:
        if arg.startswith(RUN_DIR_ARG):
            target = Path(arg[len(RUN_DIR_ARG):].strip("'\"")).resolve()
            probe = target
            while not probe.exists():
                probe = probe.parent
            _existing[target] = probe


def remove_made_run_dir() -> None:
    """Remove the empty hydra.run.dir Hydra made for a run that was refused (module docstring)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    target = Path(HydraConfig.get().run.dir).resolve()
    stop = _existing.get(target)
    path = target
    while stop is not None and path != stop and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        path = path.parent


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
    from train.run import run  # imported here so `--help` and config errors skip importing lightning

    try:
        run(cfg)
    except MISTAKES as error:
        remove_made_run_dir()
        fail(error)


def cli() -> None:
    os.environ["HYDRA_FULL_ERROR"] = "1"      # Hydra raises its composition errors instead of printing them
    note_run_dir(sys.argv[1:])
    try:
        main()
    except MISTAKES as error:
        fail(error)


if __name__ == "__main__":
    cli()
