"""Kernel timings for `specdec bench cpu --matmul-rows`: what each few-row path costs alone.

`matmul_costs(model, rows)` multiplies `rows` rows by every linear weight of an fp32 model (its
whole set of weights, streamed from memory as a decoding step streams them, without the step's
other work) by each path `few_rows.FewRowsLinear` can take; the rules of `few_rows` (how many rows
each kernel takes on which host) were set from such timings. The end-to-end figure of each piece
is `specdec bench cpu`'s own.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import check
from . import few_rows_kernel, few_rows_panels
from .few_rows import PACK_ROWS, PACKED_ROWS, mkl_packs, packs


@torch.no_grad()
def matmul_costs(model: Any, rows: list[int], repeats: int = 5, seed: int = 0) -> dict[str, dict[int, float]]:
    """Milliseconds to multiply `rows` rows by every linear weight of an fp32 `model`, by each path:
    "F.linear" (torch's own), "numba" and "panels" (where numba is installed), "onednn" (the weights
    packed for oneDNN, where torch has it) and "mkl" (packed for MKL for `PACKED_ROWS` rows, where
    torch has MKL). {path: {rows: ms}}, medians over `repeats` rounds, every path and row count
    interleaved within a round."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]
    check(bool(weights) and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights),
          "matmul_costs times an fp32 model's linear layers on the CPU")
    check(bool(rows) and all(isinstance(n, int) and n >= 1 for n in rows), f"rows must be integers >= 1, got {rows}")
    g = torch.Generator().manual_seed(seed)
    inputs = {(n, k): torch.randn(n, k, generator=g) for n in rows for k in {int(w.shape[1]) for w in weights}}
    paths: dict[str, Any] = {"F.linear": lambda n: [F.linear(inputs[n, w.shape[1]], w) for w in weights]}
    if few_rows_kernel.available():
        paths["numba"] = lambda n: [few_rows_kernel.matmul_wt(inputs[n, w.shape[1]], w) for w in weights]
        panels = [few_rows_panels.pack(w) for w in weights]
        paths["panels"] = lambda n: [few_rows_panels.matmul_panels(inputs[n, w.shape[1]], p, int(w.shape[0]))
                                     for w, p in zip(weights, panels, strict=True)]
    if packs(torch.float32):
        dnnl = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
        paths["onednn"] = lambda n: [torch.ops.mkldnn._linear_pointwise(inputs[n, w.shape[1]], p, None, "none", [], "")
                                     for w, p in zip(weights, dnnl, strict=True)]
    if mkl_packs():
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), PACKED_ROWS) for w in weights]
        paths["mkl"] = lambda n: [torch.ops.mkl._mkl_linear(inputs[n, w.shape[1]], p, w, None, n)
                                  for w, p in zip(weights, mkl, strict=True)]
    times: dict[tuple[str, int], list[float]] = {(path, n): [] for n in rows for path in paths}
    for path, n in times:                                       # once each untimed: kernels chosen, pages touched
        paths[path](n)
    for _ in range(repeats):
        for (path, n), seconds in times.items():
            t0 = time.perf_counter()
            paths[path](n)
            seconds.append(time.perf_counter() - t0)
    return {path: {n: round(statistics.median(times[path, n]) * 1e3, 2) for n in rows} for path in paths}
