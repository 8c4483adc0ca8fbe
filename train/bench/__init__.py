"""Every benchmark of specdec, one package above `train.run` (it imports `run` and `compose`,
`train.run`'s one composition of conf/); the scripts under scripts/ are its command lines.

- `decode`: plain, draft and prophet decoding side by side, c and v measured inside the same
  runs (specdec bench decode);
- `pipeline`: the Lightning pipeline (`run` itself) against a plain PyTorch loop; `train_step`:
  our train step against lucidrains'; `train_quality`: train time to a fixed prophet acceptance;
  `data`: the bytes they read (specdec bench train);
- `compare_drafts`: which draft a trained target should use, candidates trained through `run`
  (specdec bench compare-drafts);
- `drafts`: drafters of one Hugging Face target side by side (specdec bench compare-hf-drafts);
  `hf`: specdec's `generate` against transformers' `generate()` and assisted generation
  (specdec bench hf, specdec bench compare-hf);
- `benchmarks`: the prompt sets papers score on (MT-Bench's 80 two-turn questions, HumanEval's 164
  problems), read from their PyPI packages; `evaluate`: drafters scored on them as EAGLE-3 scores
  (acceptance length tau, per-position acceptance, speed-up over plain decoding, greedy equality),
  `eval_report` its JSON / markdown / PNG (specdec evaluate);
- `lucidrains`: lucidrains' speculative-decoding package at our sizes, for comparison;
- `report`: atomic JSON / markdown / PNG reports.
"""

from ..run import compose, run

__all__ = ["compose", "run"]
