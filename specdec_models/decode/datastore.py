"""A datastore of the target's own earlier answers, looked up like the prompt (REST, He et al. 2023).

Prompt lookup (`tree.lookup_continuation`) copies what followed the context's last tokens earlier
in the same context: it pays where an answer quotes its prompt or repeats itself. Where it finds
nothing, answers of one model to similar requests still share their phrasing ("Here are some tips
for", "1. **"), and the target's own answers to the training prompts, which the recipe has already
generated for its cache, hold that phrasing. `Datastore` indexes those answers by their n-grams; a
lookup takes the context's last n tokens (the largest n in [min_ngram, max_ngram] that occurs) and
returns the continuation most of their occurrences share, token by token (ties to the occurrence
seen last), so one unusual answer does not decide it.

In a draft tree (`generate(..., TreeDrafter(head, spec, store))`) the continuation is the round's
looked-up path where it follows a longer n-gram than prompt lookup's match (a tie goes to prompt
lookup): on the recipe's held-out answers, prompt lookup often matches only the last token, and a
datastore's 3-gram then predicts better. The path depends only on the committed context, never on
the round's draws, so the tree's losslessness argument for a looked-up path holds unchanged
(`decode.tree`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ..errors import SpecdecError, check, check_positive_int
from ..files import write_file

FORMAT = "specdec-datastore"


class Datastore:
    """Token rows (e.g. answers) indexed by their n-grams, n in [min_ngram, max_ngram]; each
    n-gram keeps its `keep` latest occurrences (module docstring)."""

    def __init__(self, rows: Iterable[Sequence[int]], *, min_ngram: int = 3, max_ngram: int = 3,
                 keep: int = 64) -> None:
        check_positive_int(min_ngram, "datastore min_ngram")
        check_positive_int(keep, "datastore keep")
        check(isinstance(max_ngram, int) and max_ngram >= min_ngram,
              f"datastore max_ngram must be an integer >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.min_ngram, self.max_ngram, self.keep = min_ngram, max_ngram, keep
        self.source: dict = {}
        self.rows: list[list[int]] = [list(map(int, row)) for row in rows]
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for r, row in enumerate(self.rows):
            for n in range(min_ngram, max_ngram + 1):
                for end in range(n, len(row)):           # an n-gram with at least one token after it
                    hits = self.index.setdefault(tuple(row[end - n:end]), [])
                    hits.append((r, end))
                    if len(hits) > 2 * keep:              # amortised: cut to the latest `keep`
                        del hits[:-keep]
        for key, hits in self.index.items():
            if len(hits) > keep:
                self.index[key] = hits[-keep:]

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.rows)

    def save(self, path: str | os.PathLike, source: dict | None = None) -> Path:
        """Write the rows (and the n-gram settings) to one .npz file, atomically; `source` (e.g. the
        cache and the target's weights they came from) is kept beside them."""
        path = Path(path).expanduser()
        meta = {"format": FORMAT, "min_ngram": self.min_ngram, "max_ngram": self.max_ngram, "keep": self.keep,
                "source": source or {}}
        lengths = np.array([len(r) for r in self.rows], dtype=np.int64)
        tokens = np.array([t for r in self.rows for t in r], dtype=np.int32)
        return write_file(path, lambda f: np.savez(f, tokens=tokens, lengths=lengths, meta=np.array(json.dumps(meta))))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Datastore:
        """A datastore `save` wrote; a missing or foreign file is one line."""
        path = Path(path).expanduser()
        check(path.is_file(), f"datastore {path} does not exist (write one from a regenerated cache: "
                              f"specdec bench compare-hf-drafts datastore --cache CACHE --out FILE)")
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                tokens, lengths = data["tokens"], data["lengths"]
        except (OSError, ValueError, KeyError) as error:
            raise SpecdecError(f"datastore {path} is not a datastore file ({' '.join(str(error).split())})") from None
        check(isinstance(meta, dict) and meta.get("format") == FORMAT, f"datastore {path} is not a datastore file")
        check(int(lengths.sum()) == len(tokens), f"datastore {path} is damaged")
        rows = np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
        store = cls(rows, min_ngram=meta["min_ngram"], max_ngram=meta["max_ngram"], keep=meta["keep"])
        store.source = meta.get("source", {})
        return store

    def continuation(self, context: Sequence[int], length: int) -> list[int]:
        """Up to `length` tokens to follow `context`: from the occurrences of its last n tokens
        (the largest n that occurs), at each step the next token most of the occurrences still
        agreeing with the continuation share (ties: the one seen last); [] where none occurs."""
        return self.match(context, length)[1]

    def match(self, context: Sequence[int], length: int) -> tuple[int, list[int]]:
        """(n, `continuation`): the n of the n-gram it follows (0 and [] where none occurs)."""
        if length <= 0:
            return 0, []
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            hits = self.index.get(tuple(int(t) for t in context[len(context) - n:]))
            if hits:
                break
        else:
            return 0, []
        out: list[int] = []
        while len(out) < length:
            votes = Counter()
            last: dict[int, int] = {}
            for i, (r, end) in enumerate(hits):
                at = end + len(out)
                if at < len(self.rows[r]):
                    token = self.rows[r][at]
                    votes[token] += 1
                    last[token] = i
            if not votes:
                break
            token = max(votes, key=lambda t: (votes[t], last[t]))
            out.append(token)
            hits = [(r, end) for r, end in hits if end + len(out) - 1 < len(self.rows[r])
                    and self.rows[r][end + len(out) - 1] == token]
        return n, out
