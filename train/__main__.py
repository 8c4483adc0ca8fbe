"""`python -m train experiment=enwik8_prophet`: the Hydra shell around `train.run.run`."""

import sys

import hydra
from omegaconf import DictConfig

from specdec_models.errors import SpecdecError


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from train.run import run   # imported here so `--help` and config errors skip importing lightning

    try:
        run(cfg)
    except SpecdecError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
