"""`specdec bench answers` (train/commands/bench_answers.py) by its old path, which issue 72 names:
`python scripts/bench_answers.py --help`."""

import sys

from train.commands.bench_answers import main

if __name__ == "__main__":
    sys.exit(main())
