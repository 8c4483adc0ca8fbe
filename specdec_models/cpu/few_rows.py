"""Linear layers for decoding's few-row calls on a CPU: fp32 and bf16 verification get cheap.

Decoding calls a model's linear layers on few rows: 1 for a plain step, 2-64 for a verify or a
draft tree at batch 1, or a verify at batch 8. PyTorch computes `F.linear(x, W)` = x @ W.T with its
CPU BLAS, and for a few rows that runs far below what reading the weights costs. `FewRowsLinear`
computes the same product another way, chosen by dtype, row count and host, each path the fastest
one timed on its host class (the timings and their commands: docs/cpu.md):

- fp32 on an Intel CPU (`fp32_library()` "mkl"): up to `LINEAR_ROWS` rows `F.linear` itself (it
  runs at about memory speed there, and then jumps), and from there to `PACKED_ROWS` rows MKL's
  product with the weight packed once into its own layout (`torch.ops.mkl`, where torch has MKL:
  the fp32 path torch.compile's CPU backend takes). MKL's layout is packed for 64 rows and serves
  every row count up to them; each weight shape is checked once against `F.linear` before it is
  used (a layout MKL tied to the row count would fail there, and that shape takes the rule below).
- fp32 by the "onednn" rule on a CPU with AVX2 but not AVX-512, where numba is installed
  (`kernel()` "panels", `kernel_for`): every call of up to `PACKED_ROWS` rows takes numba's panel
  kernel (`few_rows_panels`: the weight packed once into panels of 16 output columns, tiles of 6
  rows by 16 columns held in registers), level with the dot kernel at one row and faster than
  every other path from there.
- fp32 elsewhere (`fp32_library()` "onednn"), up to `SMALL_ROWS` rows (`small_rows_for`: 4 on a
  CPU with AVX-512, 10 on one without): numba's kernel (`few_rows_kernel`, when numba is installed:
  `pip install specdec[fast]`), which streams each weight row once and runs near the host's memory
  speed. Without numba, torch's own product taken the other way round, (W @ x.T).T, another MKL
  kernel. For a single row MKL's matrix-vector kernel is itself slower than its 2-row product, so
  one row is computed as two (the row twice) and the first kept.
- fp32 elsewhere, `SMALL_ROWS` + 1 to `PACKED_ROWS` rows: oneDNN's product with the weight packed
  once into its blocked layout (`torch.ops.mkldnn`), where torch has oneDNN; above `SMALL_ROWS` it
  beats numba's kernel. Without oneDNN, fp32 calls of up to `MAX_ROWS` rows take the small-row
  kernel.
- bf16, any row count: oneDNN with the packed weight, where this CPU runs oneDNN's bf16 kernels
  (`torch.ops.mkldnn._is_mkldnn_bf16_supported`). `F.linear` already calls oneDNN in bf16, but
  hands it the weight in torch's plain layout at every call; here it is in oneDNN's blocked layout,
  packed once, and the outputs are bit for bit `F.linear`'s. Where oneDNN does not run bf16, bf16
  calls are `F.linear`'s.

Same function, other rounding in fp32: the sums run in another order, so outputs differ from
`F.linear`'s in the last bits (about 1e-6 relative), as a multi-token verify already differs from a
1-token step. Above `PACKED_ROWS` rows in fp32 (a prefill, a training batch), and above `MAX_ROWS`
without oneDNN, MKL's own layout is used.
The rule `few_rows_pays(device, dtype)`: fp32 on a CPU, and bf16 on a CPU that runs oneDNN's bf16
kernels. Autograd is left to `F.linear`: a call that records gradients takes its path, so training
is unchanged. A packed weight is kept beside its layer (not in it: state_dict and copies are
untouched). It is packed when the layer is switched (the panel kernel is compiled then too, so no
decoding call pays for either) and again when the weight changes (another tensor, or an in-place
update such as an optimizer step: the evaluation callback decodes so between training steps);
switching the layer back drops it.

`fp32_library()` names the library of fp32 calls ("mkl" or "onednn") and `kernel()` the fp32
kernel of the "onednn" rule ("panels", "numba" or "torch"): `rule(off)` gives both for this host,
less the pieces a benchmark turned off (`specdec_models.cpu.pieces`); `set_fp32_library`,
`set_kernel` and `set_small_rows` (the most rows the numba and torch kernels take) change them;
`packs(dtype)` says whether oneDNN's packed path serves that dtype here.

`switch_layers(modules)` switches every plain `nn.Linear` of the modules whose dtype pays to
`FewRowsLinear` in place (the class only: parameters, tied weights and state_dict stay as they
are) and `switch_back(layers)` undoes it: `specdec_models.cpu.prepare_for_device`, the one call
decoding and the evaluation use, calls them. `use_few_rows(module, on)` switches one module's
plain linear layers whatever their dtype (tests).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpecdecError, check
from . import few_rows_kernel, few_rows_panels
from .dtypes import cpu_flags, cpu_vendor
from .pieces import env_off


def small_rows_for(flags: frozenset[str]) -> int:
    """The most rows the "onednn" rule computes with the small-row kernel on a CPU with these
    /proc/cpuinfo flags (module docstring): 4 with AVX-512 (oneDNN's packed product won from 6 rows
    on the Zen 5), 10 with AVX2 but not AVX-512 (numba's kernel won up to 10 on the Zen 3), 4 where
    the flags are unknown."""
    return 10 if "avx2" in flags and "avx512f" not in flags else 4


MAX_ROWS = 32                  # fp32 without oneDNN: the small-row kernel up to here
LINEAR_ROWS = 3                # fp32 by the "mkl" rule: F.linear itself up to here, MKL's packed product above
SMALL_ROWS = small_rows_for(cpu_flags())   # fp32 by the "onednn" rule: the small-row kernel up to here, oneDNN above
PACKED_ROWS = 64               # fp32: packed weights up to here (MKL's, or oneDNN's), F.linear above
PACK_ROWS = 16                 # the row count oneDNN chooses the packed layout for
KERNELS = ("panels", "numba", "torch")
LIBRARIES = ("mkl", "onednn")


def kernel_for(flags: frozenset[str], numba: bool) -> str:
    """The fp32 kernel of the "onednn" rule on a CPU with these /proc/cpuinfo flags (module
    docstring): "panels" with AVX2 but not AVX-512 (the Zen 3's timing), else "numba"; "torch" where
    numba is not installed."""
    if not numba:
        return "torch"
    return "panels" if "avx2" in flags and "avx512f" not in flags else "numba"




def mkl_packs() -> bool:
    """Whether this torch has MKL and the private ops of its packed fp32 product."""
    try:
        return bool(torch.backends.mkl.is_available() and callable(torch.ops.mkl._mkl_reorder_linear_weight)
                    and callable(torch.ops.mkl._mkl_linear))
    except (AttributeError, RuntimeError):                   # a torch without these private ops
        return False


# x (rows, in), packed, W, bias, rows -> x @ W.T (+ bias) by MKL with the packed weight; the row count
# is passed as the op's batch size, which makes torch take the packed product rather than F.linear.
# Looked up once: a torch.ops lookup costs microseconds, and a step makes hundreds of these calls
_MKL_LINEAR = torch.ops.mkl._mkl_linear.default if mkl_packs() else None


def rule_library() -> str:
    """The fp32 library of this host's rule: "mkl" on an Intel CPU where torch has MKL's packed
    product, else "onednn" (module docstring)."""
    return "mkl" if mkl_packs() and cpu_vendor() == "GenuineIntel" else "onednn"


def rule(off: frozenset[str] = frozenset()) -> tuple[str, str]:
    """(fp32 library, kernel) by this host's rule, less the pieces `off` ("mkl": the "onednn"
    rule; "panels": numba's dot kernel instead; "dot": torch's instead of numba's dot kernel)."""
    library = "onednn" if "mkl" in off else rule_library()
    name = kernel_for(cpu_flags(), few_rows_kernel.available())
    if name == "panels" and "panels" in off:
        name = "numba"
    if name == "numba" and "dot" in off:
        name = "torch"
    return library, name


_library, _kernel = rule(env_off())


def fp32_library() -> str:
    """The library of fp32 CPU calls of up to `PACKED_ROWS` rows: "mkl" (MKL's packed product, on an
    Intel CPU) or "onednn" (the small-row kernel, then oneDNN's packed product; module docstring)."""
    return _library


def set_fp32_library(name: str) -> str:
    """Compute fp32 CPU calls of up to `PACKED_ROWS` rows by the rule of `name`; returns the one
    used before, so a caller can restore it."""
    global _library
    check(name in LIBRARIES, f"the few-row fp32 library must be one of {', '.join(LIBRARIES)}, got {name!r}")
    check(name != "mkl" or mkl_packs(), "MKL's packed fp32 product needs a torch built with MKL (an x86 wheel)")
    before, _library = _library, name
    return before


def kernel() -> str:
    """The kernel of fp32 CPU products by the "onednn" rule: "panels" (every call of up to
    `PACKED_ROWS` rows), or "numba" or "torch" (calls of up to `SMALL_ROWS` rows, and of up to
    `MAX_ROWS` where torch has no oneDNN)."""
    return _kernel


def set_kernel(name: str) -> str:
    """Compute fp32 CPU few-row products with `name` ("panels" and "numba" need numba installed);
    returns the kernel used before, so a caller can restore it."""
    global _kernel
    check(name in KERNELS, f"the few-row kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    check(name == "torch" or few_rows_kernel.available(),
          f"the {name} few-row kernel needs numba: pip install 'specdec[fast]' (or numba)")
    before, _kernel = _kernel, name
    return before


def set_fp32_rule(library: str, kernel_name: str) -> tuple[str, str]:
    """Compute fp32 CPU few-row calls with `library` and `kernel_name` together (`set_fp32_library`
    and `set_kernel`, with their checks); returns the (library, kernel) used before, so a caller can
    restore it. The one way another module changes this one's choice: `pieces.pieces_off` sets the
    `rule` less the pieces off, then restores the pair it found."""
    before = fp32_library(), kernel()
    set_fp32_library(library)
    try:
        set_kernel(kernel_name)
    except SpecdecError:
        set_fp32_library(before[0])
        raise
    return before


def set_small_rows(rows: int) -> int:
    """Compute fp32 CPU products of up to `rows` rows with the small-row kernel by the "onednn" rule
    (1 to `MAX_ROWS`; the default is `small_rows_for` this CPU's flags); returns the count used
    before, so a caller can restore it (or time one rule against another)."""
    global SMALL_ROWS
    check(isinstance(rows, int) and not isinstance(rows, bool) and 1 <= rows <= MAX_ROWS,
          f"the small-row kernel's rows must be an integer from 1 to {MAX_ROWS}, got {rows!r}")
    before, SMALL_ROWS = SMALL_ROWS, rows
    return before


class FewRowsLinear(nn.Linear):
    """An `nn.Linear` that computes decoding's few-row calls on a CPU with the kernels of the module
    docstring: MKL with a packed weight for fp32 calls on an Intel CPU; elsewhere numba's or torch's
    (W @ x.T).T for small fp32 calls and oneDNN with a packed weight for larger ones; oneDNN with a
    packed weight for bf16."""

    def _apply(self, fn, *args, **kwargs):
        # a cast or a move (.to, .bfloat16, .cuda) leaves a packed weight stale: drop it rather than keep
        # its memory while the layer lives; the next call that uses one packs anew
        _packed.pop(self, None)
        _arrays.pop(self, None)
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        weight = self.weight
        # first, with as few checks as can be: a plain step's hundreds of calls take this path by the "mkl" rule
        if rows == 0 or (rows <= LINEAR_ROWS and _library == "mkl" and x.dtype == torch.float32):
            return F.linear(x, weight, self.bias)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return F.linear(x, weight, self.bias)
        cpu = x.is_cpu and x.dtype == weight.dtype
        if cpu and x.dtype == torch.bfloat16:                             # any row count: F.linear's bits
            return _packed_linear(self, x) if packs(torch.bfloat16) else F.linear(x, weight, self.bias)
        if cpu and x.dtype == torch.float32 and _library == "mkl":
            if rows > PACKED_ROWS:
                return F.linear(x, weight, self.bias)
            packed = _packed_weight(self, "mkl")
            if packed is not None:                          # None: a shape MKL's layout failed the check for
                flat = x.reshape(rows, self.in_features)
                out = _MKL_LINEAR(flat if flat.is_contiguous() else flat.contiguous(), packed, weight, self.bias, rows)
                return out if x.dim() == 2 else out.view(x.shape[:-1] + (self.out_features,))
        if cpu and x.dtype == torch.float32 and _kernel == "panels":
            if rows > PACKED_ROWS:
                return F.linear(x, weight, self.bias)
            flat = x if x.dim() == 2 else x.reshape(rows, self.in_features)
            shape = None if flat is x else (*x.shape[:-1], self.out_features)
            out = few_rows_panels.matmul_panels(flat, _packed_weight(self, "panels"), self.out_features, shape)
            if self.bias is not None:
                out += self.bias
            return out
        if cpu and x.dtype == torch.float32 and SMALL_ROWS < rows <= PACKED_ROWS and packs(torch.float32):
            return _packed_linear(self, x)
        if rows > MAX_ROWS:
            return F.linear(x, weight, self.bias)
        flat = x if x.dim() == 2 else x.reshape(rows, self.in_features)
        if _kernel == "numba" and cpu and x.dtype == torch.float32:
            shape = None if flat is x else (*x.shape[:-1], self.out_features)      # ints, not a torch.Size
            out = few_rows_kernel.matmul_wt(flat, weight, _weight_array(self), shape)
            if self.bias is not None:
                out += self.bias
            return out
        if rows == 1:
            flat = torch.cat([flat, flat])
        out = torch.mm(weight, flat.t()).t()[:rows]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], self.out_features)


# a layer's packed weight: (the weight it was packed from, its version, the library, its storage's
# address, the packed tensor); kept beside the layer (weakly) because packed tensors cannot be copied
# or saved
_packed: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
# weight shape -> whether MKL's layout packed for PACKED_ROWS rows computes every row count right here
_mkl_shapes: dict[tuple[int, int], bool] = {}
MKL_CHECK_ROWS = (1, 2, 3, 5, 16, 17, 33, PACKED_ROWS)


def _packed_weight(layer: nn.Linear, library: str = "onednn") -> Tensor | None:
    """The layer's weight packed for `library` ("mkl", "onednn", or "panels": a numpy array of
    `few_rows_panels.pack`): packed once, again when the weight changed (another tensor, other
    storage, or an in-place update); None for MKL where its layout failed the check for this
    weight's shape."""
    weight = layer.weight
    hit = _packed.get(layer)
    if (hit is not None and hit[0] is weight and hit[1] == weight._version and hit[2] == library
            and hit[3] == weight.data_ptr()):
        return hit[4]                                 # every decoding call: the checks kept few and cheap
    if library == "mkl" and _mkl_shapes.get(tuple(weight.shape)) is False:
        return None                                   # this shape takes the "onednn" rule instead
    with torch.no_grad():
        w = weight.detach()
        if library == "mkl":
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), PACKED_ROWS)
            packed = packed if _mkl_layout_checked(w, packed) else None
        elif library == "panels":
            packed = few_rows_panels.pack(w)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
    _packed[layer] = (weight, weight._version, library, weight.data_ptr(), packed)
    return packed


# a layer's weight as a numpy array for numba's kernel: (the weight, its version, its storage's address,
# the array, which shares the weight's memory); kept beside the layer like a packed weight
_arrays: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def _weight_array(layer: nn.Linear) -> np.ndarray:
    """The layer's fp32 weight as a numpy array sharing its memory, made again when the weight is
    another tensor, storage or version: the checks `_packed_weight` makes (an in-place update would
    show through the shared memory anyway)."""
    weight = layer.weight
    hit = _arrays.get(layer)
    if hit is not None and hit[0] is weight and hit[1] == weight._version and hit[2] == weight.data_ptr():
        return hit[3]
    array = weight.detach().contiguous().numpy()
    _arrays[layer] = (weight, weight._version, weight.data_ptr(), array)
    return array


def _mkl_layout_checked(weight: Tensor, packed: Tensor) -> bool:
    """Whether MKL's product with `packed` (packed for PACKED_ROWS rows) equals `F.linear` up to
    fp32 rounding at the row counts MKL_CHECK_ROWS; checked once per weight shape. MKL documents
    its packed product without saying whether a layout packed for one row count serves others: on
    the hosts timed it did (a wrong layout would give wrong sums, not rounding differences)."""
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    if shape not in _mkl_shapes:
        generator = torch.Generator().manual_seed(0)
        ok = True
        for rows in MKL_CHECK_ROWS:
            x = torch.randn(rows, shape[1], generator=generator)
            want = F.linear(x, weight)
            got = _MKL_LINEAR(x, packed, weight, None, rows)
            ok = ok and bool((got - want).abs().max() <= 1e-4 * (want.abs().max() + 1e-6))
        _mkl_shapes[shape] = ok
    return _mkl_shapes[shape]


def _packed_linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """x @ W.T (+ bias) with oneDNN and the layer's packed weight."""
    flat = x.reshape(-1, layer.in_features)
    out = torch.ops.mkldnn._linear_pointwise(flat, _packed_weight(layer), layer.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], layer.out_features)


def _pack(layers: Iterable[nn.Module]) -> None:
    """Pack the weights the packed path will read now, so no decoding call pays for it (a timed
    call would): fp32 CPU weights for MKL on its rule, bf16 and fp32 ones for oneDNN where it serves
    their dtype."""
    for layer in layers:
        w = layer.weight
        if w.device.type != "cpu":
            continue
        if w.dtype == torch.float32 and _library == "mkl":
            _packed_weight(layer, "mkl")
        elif w.dtype == torch.float32 and _kernel == "panels":
            _packed_weight(layer, "panels")
            few_rows_panels.compile_kernel()             # once per process: a cached call after that
        elif w.dtype in (torch.float32, torch.bfloat16) and packs(w.dtype):
            _packed_weight(layer)


def _forget_packed(layers: Iterable[nn.Module]) -> None:
    for layer in layers:
        _packed.pop(layer, None)
        _arrays.pop(layer, None)


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
    if dtype == torch.float32 and _library == "mkl":
        return f"F.linear up to {LINEAR_ROWS} rows, MKL with packed weights up to {PACKED_ROWS}"
    if dtype == torch.float32 and _kernel == "panels":
        return f"numba's panel kernel up to {PACKED_ROWS} rows"
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


def switch_layers(modules: Iterable[nn.Module]) -> list[nn.Linear]:
    """Switch every plain `nn.Linear` of `modules` (each once, however often it is shared) whose
    weight's device and dtype `few_rows_pays` to `FewRowsLinear`, in place, packing its weight now;
    returns the layers switched, for `switch_back`."""
    found = {id(layer): layer for module in modules for layer in module.modules()
             if type(layer) is nn.Linear and few_rows_pays(layer.weight.device, layer.weight.dtype)}
    switched = list(found.values())
    for layer in switched:
        layer.__class__ = FewRowsLinear
    _pack(switched)
    return switched


def switch_back(layers: Iterable[nn.Module]) -> None:
    """Make `layers` (switched by `switch_layers`) plain `nn.Linear`s again and drop their packed weights."""
    layers = [layer for layer in layers if type(layer) is FewRowsLinear]
    for layer in layers:
        layer.__class__ = nn.Linear
    _forget_packed(layers)
