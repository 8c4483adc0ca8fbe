"""`specdec eagle3` (train/commands/eagle3.py) by its old path, for the tools that call it so
(../shared/tools/gpu-recipe/call2.sh): `python scripts/eagle3.py --help`."""

import sys

from train.commands.eagle3 import main

if __name__ == "__main__":
    sys.exit(main())
