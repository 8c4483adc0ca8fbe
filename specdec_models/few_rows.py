"""Linear layers for decoding's few-row calls on a CPU: fp32 and bf16 verification get cheap.

Decoding calls a model's linear layers on few rows: 1 for a plain step, 2-64 for a verify or a
draft tree at batch 1, or a verify at batch 8. PyTorch computes `F.linear(x, W)` = x @ W.T with its
CPU BLAS, and for a few rows that runs far below what reading the weights costs. `FewRowsLinear` computes the same
product another way, chosen by dtype and row count (timed on the hosts of docs/smollm2_history.md:
"Few-row fp32 matmuls", "A numba kernel for few rows" and "Packed bf16 weights for decoding"):

- fp32, up to `SMALL_ROWS` rows: numba's kernel (`few_rows_kernel`, when numba is installed:
  `pip install specdec[fast]`), which streams each weight row once and runs near the host's
  memory speed; on the AMD EPYC (AVX2) it made plain fp32 decoding of SmolLM2-135M 1.3-1.4x
  faster. Without numba, torch's own product taken the other way round, (W @ x.T).T, another MKL
  kernel: there a 4-token verify cost 0.91-0.93 of torch's 1-token step. For a single row MKL's
  matrix-vector kernel is itself slower than its 2-row product, so one row is computed as two (the
  row twice) and the first kept.
- fp32, `SMALL_ROWS` + 1 to `PACKED_ROWS` rows: oneDNN's product with the weight packed once into
  its blocked layout (`torch.ops.mkldnn`, the path torch.compile's CPU backend takes), where torch
  has oneDNN; on the AMD EPYC with avx512_bf16 it beat numba's kernel from 6 rows on (8 rows: 85 us
  against 103 for a 1536 x 576 weight) and SmolLM2's 16-token verify took 68 ms against 102. On
  the Intel Xeon without bf16 instructions, SmolLM2's five weight shapes (its LM head included)
  took 2.0-2.1x less time than `F.linear` at 40 rows, 1.4x less at 64, about the same from 128 on
  ("Batch 8 at gammas 1 to 4"): a batch-8 verify of 5 tokens (40 rows) takes this path.
  Without oneDNN, fp32 calls of up to `MAX_ROWS` rows take the small-row kernel.
- bf16, any row count: oneDNN with the packed weight, where this CPU runs oneDNN's bf16 kernels
  (`torch.ops.mkldnn._is_mkldnn_bf16_supported`). `F.linear` already calls oneDNN in bf16, but
  hands it the weight in torch's plain layout at every call; here it is in oneDNN's blocked layout,
  packed once. The outputs are bit for bit `F.linear`'s, and on the EPYC with avx512_bf16 a 1-token step of
  SmolLM2 took 35 ms instead of 43 and an 8-token verify 39 instead of 53. Where oneDNN does not
  run bf16, bf16 calls are `F.linear`'s (torch's (W @ x.T).T gained nothing in bf16 on the hosts
  timed).

Same function, other rounding in fp32: the sums run in another order, so outputs differ from
`F.linear`'s in the last bits (about 1e-6 relative), as a multi-token verify already differs from a
1-token step. Above `PACKED_ROWS` rows in fp32 (a prefill, a training batch), and above `MAX_ROWS`
without oneDNN, MKL's own layout is used.
The rule `few_rows_pays(device, dtype)`: fp32 on a CPU, and bf16 on a CPU that runs oneDNN's bf16
kernels. Autograd is left to `F.linear`: a call that records gradients takes its path, so training
is unchanged. A packed weight is kept beside its layer (not in it: state_dict and copies are
untouched). It is packed when the layer is switched (so no decoding call pays for it) and again
when the weight changes (another tensor, or an in-place update such as an optimizer step: the
evaluation callback decodes so between training steps); switching the layer back drops it.

`kernel()` names the small-row fp32 kernel in use, `set_kernel` picks one
(`SPECDEC_FEW_ROWS_KERNEL=torch` in the environment does it at import); `packs(dtype)` says whether
oneDNN's packed path serves that dtype here.

`use_few_rows(module)` switches every `nn.Linear` of a module to `FewRowsLinear` in place (the
class only: parameters, tied weights and state_dict stay as they are); `use_few_rows(module,
False)` switches them back. The decoding CLI and the comparisons apply it to the target and its
drafters alike (`--few-rows auto`), so plain decoding gets the faster 1-row step too.
`few_rows_while(modules)` switches them for a block of code, then back exactly the layers it
switched: the evaluation callback decodes so between training steps (`few_rows: auto`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import few_rows_kernel
from .errors import check

MAX_ROWS = 32                  # fp32 without oneDNN: the small-row kernel up to here
SMALL_ROWS = 4                 # fp32: the small-row kernel up to here, oneDNN's packed weights above
PACKED_ROWS = 64               # fp32: oneDNN's packed weights up to here, MKL's own layout above
PACK_ROWS = 16                 # the row count oneDNN chooses the packed layout for
KERNELS = ("numba", "torch")
_kernel = "numba" if few_rows_kernel.available() else "torch"


def kernel() -> str:
    """The kernel `FewRowsLinear` computes fp32 CPU products of up to `SMALL_ROWS` rows with (and of
    up to `MAX_ROWS` where torch has no oneDNN): "numba" or "torch"."""
    return _kernel


def set_kernel(name: str) -> str:
    """Compute fp32 CPU small-row products with `name` ("numba" needs numba installed); returns the
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
    """An `nn.Linear` that computes decoding's few-row calls on a CPU with the kernels of the module
    docstring: numba's or torch's (W @ x.T).T for small fp32 calls, oneDNN with a packed weight for
    larger fp32 calls and for bf16."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        weight = self.weight
        if rows == 0 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, self.bias)
        cpu = x.device.type == "cpu" and x.dtype == weight.dtype
        if cpu and x.dtype == torch.bfloat16:                             # any row count: F.linear's bits
            return _packed_linear(self, x) if packs(torch.bfloat16) else F.linear(x, weight, self.bias)
        if cpu and x.dtype == torch.float32 and SMALL_ROWS < rows <= PACKED_ROWS and packs(torch.float32):
            return _packed_linear(self, x)
        if rows > MAX_ROWS:
            return F.linear(x, weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if _kernel == "numba" and cpu and x.dtype == torch.float32:
            out = few_rows_kernel.matmul_wt(flat, weight)
            if self.bias is not None:
                out += self.bias
            return out.reshape(*x.shape[:-1], self.out_features)
        if rows == 1:
            flat = torch.cat([flat, flat])
        out = torch.mm(weight, flat.t()).t()[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)


# a layer's packed weight, with the weight's identity and version it was packed from; kept beside
# the layer (weakly) because oneDNN's packed tensors cannot be copied or saved
_packed: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Tensor]] = weakref.WeakKeyDictionary()


def _packed_weight(layer: nn.Linear) -> Tensor:
    """The layer's weight packed for oneDNN: packed once, again when the weight changed."""
    weight = layer.weight
    key = (id(weight), weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape))
    hit = _packed.get(layer)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS))
        _packed[layer] = hit
    return hit[1]


def _packed_linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """x @ W.T (+ bias) with oneDNN and the layer's packed weight."""
    flat = x.reshape(-1, layer.in_features)
    out = torch.ops.mkldnn._linear_pointwise(flat, _packed_weight(layer), layer.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], layer.out_features)


def _pack(layers: Iterable[nn.Module]) -> None:
    """Pack the weights the packed path will read now, so no decoding call pays for it (a timed
    call would): bf16 and fp32 CPU weights where oneDNN serves their dtype."""
    for layer in layers:
        w = layer.weight
        if w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and packs(w.dtype):
            _packed_weight(layer)


def _forget_packed(layers: Iterable[nn.Module]) -> None:
    for layer in layers:
        _packed.pop(layer, None)


_packs: dict[torch.dtype, bool] = {}


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed-weight product serves `dtype` on this CPU: torch built with oneDNN,
    and for bf16 a CPU that runs its bf16 kernels (AVX-512 or newer); fp32 and bf16 only."""
    if dtype not in _packs:
        ok = dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
        try:
            ok = ok and callable(torch.ops.mkldnn._reorder_linear_weight) and callable(
                torch.ops.mkldnn._linear_pointwise)
            if ok and dtype == torch.bfloat16:
                ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):               # a torch without these private ops
            ok = False
        _packs[dtype] = bool(ok)
    return _packs[dtype]


def describe(dtype: torch.dtype) -> str:
    """What `FewRowsLinear` computes `dtype`'s few-row CPU calls with, in words (for reports)."""
    small = "numba's kernel" if _kernel == "numba" else "W @ x.T"
    if dtype == torch.bfloat16:
        return "oneDNN with packed weights" if packs(dtype) else "F.linear (oneDNN cannot run bf16 here)"
    if dtype == torch.float32 and packs(dtype):
        return f"{small} up to {SMALL_ROWS} rows, oneDNN with packed weights up to {PACKED_ROWS}"
    return f"{small} up to {MAX_ROWS} rows"


def few_rows_pays(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `FewRowsLinear` is the faster layer: fp32 on a CPU, and bf16 on a CPU where oneDNN
    runs bf16 (module docstring)."""
    return torch.device(device).type == "cpu" and (dtype == torch.float32 or (dtype == torch.bfloat16
                                                                             and packs(torch.bfloat16)))


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
            (_pack if on else _forget_packed)([layer])
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
    _pack(switched)
    try:
        yield len(switched)
    finally:
        for layer in switched:
            layer.__class__ = nn.Linear
        _forget_packed(switched)


def resolve_few_rows(setting: str, device: torch.device | str, dtype: torch.dtype, name: str = "--few-rows") -> bool:
    """The command lines' `--few-rows auto|on|off` (or the setting `name`): auto is
    `few_rows_pays(device, dtype)`."""
    check(setting in ("auto", "on", "off"), f"{name} must be auto, on or off, got {setting!r}")
    return few_rows_pays(device, dtype) if setting == "auto" else setting == "on"
