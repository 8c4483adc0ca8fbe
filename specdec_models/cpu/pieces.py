"""The CPU corner's pieces by name, and how a benchmark turns one off.

Each piece is a rule the corner applies by itself where this host's flags say it pays; none is a
user option. To measure what one buys, turn it off:
- in a process, for a block: `with pieces_off({"dot"}): ...` (`specdec bench cpu` does so,
  interleaving pieces on and off prompt by prompt);
- for a whole run: `SPECDEC_CPU_OFF=dot,panels specdec decode ...` (the one
  environment variable the corner reads, once, at import; a name it does not know is a one-line
  error at the first `prepare_for_device`).

What a piece off means: "bf16" decodes in fp32 where "auto" would pick bf16; "linear" leaves
torch's own linear layers (no few-row layers); "mkl" computes fp32 few-row calls by the "onednn" rule instead of MKL's
packed product; "panels" takes numba's dot kernel instead of the panel kernel; "dot" takes
torch's (W @ x.T).T instead of numba's dot kernel.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from ..errors import SpecdecError, check

PIECES = {
    "bf16": "bf16 decoding where the CPU has bf16 dot-product instructions (dtypes.fast_dtype)",
    "linear": "few-row linear layers (few_rows.FewRowsLinear; fp32, and bf16 where oneDNN runs it)",
    "mkl": "MKL's packed fp32 product for 4-64 rows, on an Intel CPU",
    "dot": "numba's few-row dot kernel for fp32 (few_rows_kernel)",
    "panels": "the LLVM panel kernel for fp32, on a CPU with AVX2 but not AVX-512 (few_rows_panels)",
}
ENV = "SPECDEC_CPU_OFF"
_ENV_TEXT = os.environ.get(ENV, "")            # read once, here
_forced: frozenset[str] = frozenset()          # turned off by `pieces_off` blocks


def _parse(text: str) -> frozenset[str]:
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - PIECES.keys())
    check(not unknown, f"{ENV}={text!r}: no piece {', '.join(unknown)}; the pieces are {', '.join(PIECES)}")
    return names


def env_off() -> frozenset[str]:
    """The pieces SPECDEC_CPU_OFF turned off (none where it names a piece that is not one: `off`
    says so)."""
    try:
        return _parse(_ENV_TEXT)
    except SpecdecError:
        return frozenset()


def off() -> frozenset[str]:
    """The pieces off now: SPECDEC_CPU_OFF's and those of the `pieces_off` blocks around this call;
    a one-line SpecdecError where SPECDEC_CPU_OFF names a piece that is not one."""
    return _parse(_ENV_TEXT) | _forced


@contextmanager
def pieces_off(names: Iterable[str]) -> Iterator[frozenset[str]]:
    """Within the block, the pieces `names` are off (besides those already off): the dtype rule and
    `prepare_for_device` honour it, and the few-row layers' fp32 library and kernel are this host's
    rule less the pieces off (set through `few_rows.set_fp32_rule`, the owner's setter: this module
    writes no other module's globals); afterwards all is as before. Yields the pieces off."""
    global _forced
    from . import few_rows

    names = frozenset(names)
    check(names <= PIECES.keys(), f"pieces_off: no piece {', '.join(sorted(names - PIECES.keys()))}; the pieces "
                                  f"are {', '.join(PIECES)}")
    before, rule_before = _forced, None
    _forced = _forced | names
    try:
        now = off()
        rule_before = few_rows.set_fp32_rule(*few_rows.rule(now))
        yield now
    finally:
        _forced = before
        if rule_before is not None:
            few_rows.set_fp32_rule(*rule_before)
