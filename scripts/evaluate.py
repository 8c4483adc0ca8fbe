"""`specdec evaluate` (train/commands/evaluate.py) by its old path, for the tools that call it so
(../shared/tools/gpu-recipe/call2.sh): `python scripts/evaluate.py --help`."""

import sys

from train.commands.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
