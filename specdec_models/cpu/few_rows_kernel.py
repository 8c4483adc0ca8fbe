"""A numba kernel for `few_rows.FewRowsLinear`: out = x @ W.T for 1 to 32 rows of fp32 on a CPU.
(On a CPU with AVX2 but not AVX-512, `few_rows_panels`' kernel, on packed weights, takes every
few-row call instead: it is as fast for one row and faster from a few rows on.)

Decoding reads every weight once per call and multiplies it by few rows, so a call should cost about
what reading the weights costs; MKL's few-row product runs well below that on an AVX2 EPYC
(docs/cpu.md). This kernel streams each weight row once and takes its dot products with the rows of
x four at a time while the weight row sits in L1 (each x row is read from cache), the output rows
split between threads (kernels alone: `specdec bench cpu --matmul-rows 1,4,8,16`; end to
end: `specdec bench cpu`, the piece "dot"). It is plain numba
(`njit(parallel=True, fastmath=True)`): LLVM vectorises the dot products for the host's own
instructions.

Other rounding: `fastmath` lets LLVM reorder each dot product's sums (8 partial sums per vector
lane, then a horizontal add), so outputs differ from `F.linear`'s in the last bits, as the torch
few-row path's already do. Numba is optional (`pip install specdec[fast]`): `available()` says
whether it is installed, and `few_rows` falls back to torch's matmul without it. The kernel compiles
on its first call (a few seconds; cached beside this file where that is writable).

Threads: numba starts its thread pool once, of NUMBA_NUM_THREADS threads (by default one per core),
and its OpenMP workers spin between products. A process that runs torch on fewer threads than the
host has cores (the recipe trains two heads side by side with OMP_NUM_THREADS=1 each, and each
decodes at the end of its training) would still start a pool of every core, and two such processes
fight over the cores (docs/cpu.md). So unless NUMBA_NUM_THREADS is set, the pool gets torch's thread
count at the first product (`_pool_size`); a product then runs on min(torch's threads, the pool),
told to numba only when that count changes (telling it costs microseconds, a share of a 1-row
product).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from functools import cache

import numpy as np
import torch
from torch import Tensor


def available() -> bool:
    """Whether numba is installed, so `matmul_wt` can run (it is imported on the first product:
    importing it costs about a second)."""
    return importlib.util.find_spec("numba") is not None


def _pool_size() -> None:
    """Size numba's thread pool to torch's threads, unless NUMBA_NUM_THREADS says otherwise: it is
    read when numba is imported (the module docstring)."""
    os.environ.setdefault("NUMBA_NUM_THREADS", str(torch.get_num_threads()))


@cache
def _compiled():
    """The kernel, compiled on first use (numba's cache keeps the machine code beside this file)."""
    _pool_size()
    import numba

    @numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
    def xwt(w, x):                         # pragma: no cover - compiled; checked against F.linear in the tests
        n_out, k_in = w.shape
        rows = x.shape[0]
        out = np.empty((rows, n_out), np.float32)     # allocated here: cheaper than torch.empty and .numpy()
        for n in numba.prange(n_out):
            r = 0
            while r + 4 <= rows:                        # four rows of x per pass over the weight row
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for k in range(k_in):
                    wk = w[n, k]
                    a0 += wk * x[r, k]
                    a1 += wk * x[r + 1, k]
                    a2 += wk * x[r + 2, k]
                    a3 += wk * x[r + 3, k]
                out[r, n] = a0
                out[r + 1, n] = a1
                out[r + 2, n] = a2
                out[r + 3, n] = a3
                r += 4
            while r + 2 <= rows:
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                for k in range(k_in):
                    wk = w[n, k]
                    a0 += wk * x[r, k]
                    a1 += wk * x[r + 1, k]
                out[r, n] = a0
                out[r + 1, n] = a1
                r += 2
            if r < rows:
                a0 = np.float32(0.0)
                for k in range(k_in):
                    a0 += w[n, k] * x[r, k]
                out[r, n] = a0
        return out

    return numba, xwt


# the thread count numba was last told to use in this Python thread (numba's setting is per thread, and
# so is this record: a new thread starts without one): setting it costs microseconds, and a decoding
# step makes hundreds of products
_told = threading.local()


def tell_threads(numba) -> None:
    """Run numba's next products on min(torch's threads, numba's pool), telling numba only when
    that count changed in this Python thread (the module docstring): shared with `few_rows_panels`."""
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if getattr(_told, "threads", None) != threads:
        numba.set_num_threads(threads)
        _told.threads = threads


def matmul_wt(x: Tensor, weight: Tensor, array: np.ndarray | None = None,
              shape: tuple[int, ...] | None = None) -> Tensor:
    """x @ weight.T for x (rows, in) and weight (out, in), both fp32 CPU tensors: a new (rows, out)
    tensor, or of `shape` (a tuple of ints, rows x out in all). The caller checks dtype, device and
    that no gradient is wanted (`few_rows`); `array`, where given, is `weight` as a numpy array
    (`few_rows` keeps one per layer: making it costs microseconds at every call). The shape is set
    in numpy, before torch sees the array: a view of a tensor made from numpy costs microseconds,
    and a decoding step makes hundreds of products."""
    numba, xwt = _compiled()
    tell_threads(numba)
    if array is None:
        array = weight.detach().contiguous().numpy()
    out = xwt(array, x.contiguous().numpy())
    return torch.from_numpy(out if shape is None else out.reshape(shape))
