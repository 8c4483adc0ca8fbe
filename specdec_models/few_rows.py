"""Linear layers computed as W @ x.T when a call has few rows: fp32 verification on a CPU gets cheap.

Decoding calls a model's linear layers on few rows: 1 for a plain step, 2-32 for a verify or a
draft tree at batch 1. PyTorch computes `F.linear(x, W)` = x @ W.T with its CPU BLAS (MKL). For a
few rows MKL's fp32 kernel for that layout runs far below what reading the weights costs: on the
AMD EPYC host of README "Which dtype, on which host" (AVX2, 2 threads, MKL 2024.2), SmolLM2-135M's
fp32 verify of 4 new tokens took 1.6-1.8x a 1-token step. The same product taken the other way
round, (W @ x.T).T, takes another MKL kernel (we timed it, we did not trace MKL's choice): there
the 4-token verify costs 0.91-0.93 of torch's 1-token step, 8 tokens 1.2-1.4 and 16 tokens 1.6
(README, "Few-row fp32 matmuls"). For a single row MKL's matrix-vector kernel is itself slower
than its 2-row product, so one row is computed as two (the row twice) and the first kept: the
1-token step takes 0.81 of torch's. Above `MAX_ROWS` rows (a prefill, a training batch) MKL's own
layout is used.

Same function, other rounding: the sums run in another order, so outputs differ from `F.linear`'s
in the last bits (about 1e-6 relative), as a multi-token verify already differs from a 1-token
step. bf16 gains nothing (measured: every row count as fast or slower), so the rule
`few_rows_pays(device, dtype)` is fp32 on a CPU. Autograd is left to `F.linear`: a call that
records gradients takes MKL's path, so training is unchanged.

Two kernels compute the few-row product: numba's (`few_rows_kernel`, when numba is installed:
`pip install specdec[fast]`), which streams each weight row once and runs near the host's memory
speed for a few rows, and torch's (W @ x.T above). `kernel()` names the one in use, `set_kernel`
picks one (`SPECDEC_FEW_ROWS_KERNEL=torch` in the environment does it at import): on the EPYC
numba's made plain fp32 decoding of SmolLM2-135M 1.3-1.4x faster, and speculative decoding as
much (README, "A numba kernel for few rows").

`use_few_rows(module)` switches every `nn.Linear` of a module to `FewRowsLinear` in place (the
class only: parameters, tied weights and state_dict stay as they are); `use_few_rows(module,
False)` switches them back. The decoding CLI and the comparisons apply it to the target and its
drafters alike (`--few-rows auto`), so plain decoding gets the faster 1-row step too.
`few_rows_while(modules)` switches them for a block of code, then back exactly the layers it
switched: the evaluation callback decodes so between training steps (`few_rows: auto`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import few_rows_kernel
from .errors import check

MAX_ROWS = 32
KERNELS = ("numba", "torch")
_kernel = "numba" if few_rows_kernel.available() else "torch"


def kernel() -> str:
    """The kernel `FewRowsLinear` computes fp32 CPU products with: "numba" or "torch"."""
    return _kernel


def set_kernel(name: str) -> str:
    """Compute fp32 CPU few-row products with `name` ("numba" needs numba installed); returns the
    kernel used before, so a caller can restore it."""
    global _kernel
    check(name in KERNELS, f"the few-row kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    check(name != "numba" or few_rows_kernel.available(),
          "the numba few-row kernel needs numba: pip install 'specdec[fast]' (or numba)")
    before, _kernel = _kernel, name
    return before


if os.environ.get("SPECDEC_FEW_ROWS_KERNEL"):
    set_kernel(os.environ["SPECDEC_FEW_ROWS_KERNEL"])


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` that computes 1 to `MAX_ROWS` rows as (W @ x.T).T (module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if not 1 <= rows <= MAX_ROWS or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if _kernel == "numba" and flat.device.type == "cpu" and flat.dtype == self.weight.dtype == torch.float32:
            out = few_rows_kernel.matmul_wt(flat, self.weight)
            if self.bias is not None:
                out += self.bias
            return out.reshape(*x.shape[:-1], self.out_features)
        if rows == 1:
            flat = torch.cat([flat, flat])
        out = torch.mm(self.weight, flat.t()).t()[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)


def few_rows_pays(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `FewRowsLinear` is the faster layer: fp32 on a CPU (module docstring)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def use_few_rows(module: nn.Module, on: bool = True) -> int:
    """Switch every plain `nn.Linear` of `module` to `FewRowsLinear` (on) or back (off), in place;
    returns how many layers were switched. Subclasses of `nn.Linear` other than these two keep
    their own forward."""
    check(isinstance(module, nn.Module), f"use_few_rows needs a torch module, got {type(module).__name__}")
    before, after = (nn.Linear, FewRowsLinear) if on else (FewRowsLinear, nn.Linear)
    switched = 0
    for layer in module.modules():
        if type(layer) is before:
            layer.__class__ = after
            switched += 1
    return switched


@contextmanager
def few_rows_while(modules: Iterable[nn.Module], on: bool = True) -> Iterator[int]:
    """Within the block, every plain `nn.Linear` of `modules` is a `FewRowsLinear` (`on`; else
    nothing changes); afterwards exactly the layers switched here are plain again, however the
    block ends. Yields how many layers were switched."""
    found = {id(layer): layer for module in modules for layer in module.modules() if type(layer) is nn.Linear}
    switched = list(found.values()) if on else []
    for layer in switched:
        layer.__class__ = FewRowsLinear
    try:
        yield len(switched)
    finally:
        for layer in switched:
            layer.__class__ = nn.Linear


def resolve_few_rows(setting: str, device: torch.device | str, dtype: torch.dtype, name: str = "--few-rows") -> bool:
    """The command lines' `--few-rows auto|on|off` (or the setting `name`): auto is
    `few_rows_pays(device, dtype)`."""
    check(setting in ("auto", "on", "off"), f"{name} must be auto, on or off, got {setting!r}")
    return few_rows_pays(device, dtype) if setting == "auto" else setting == "on"
