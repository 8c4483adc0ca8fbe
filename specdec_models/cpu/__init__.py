"""The CPU corner: everything that tunes decoding for the CPU it runs on, behind one call.

    prepared = prepare_for_device([target, draft_or_head], device="cpu", dtype="auto")
    prepared.dtype                      # the dtype resolved for the device (here: by the CPU's flags)
    with prepare_for_device(modules, device, dtype=None): ...   # the layers switched back afterwards

`prepare_for_device(models, device, dtype)` moves the models to `device`, casts them to `dtype`
("auto": the dtype decoding runs faster in there, `fast_dtype`; "float32", "bfloat16", a
torch.dtype; None: each keeps its own), and on a CPU switches their linear layers to few-row
layers where these pay for the layer's dtype (`few_rows.FewRowsLinear`: numba's dot kernel,
the LLVM panel kernel, MKL's or oneDNN's packed weights, chosen by the CPU's flags). Decoding (the
CLI, the comparisons, the benches) and the evaluation callback call it; nothing outside this
package names a kernel or a CPU flag. It returns a `Prepared`: the device and dtype, and
`undo()` (also on leaving a `with` block) to switch exactly those layers back, as the evaluation
callback does between training steps (a cast or a move stays).

The rules read the CPU's flags, never a clock, so one machine always answers the same:
- `fast_dtype(device)` / `resolve_dtype(name, device)`: bf16 on a CPU with bf16 dot-product
  instructions (avx512_bf16, amx_bf16) or a CUDA device with bf16, else fp32 (`dtypes`);
- `parse_dtype` / `add_dtype_argument`: the one dtype vocabulary of every command line (auto,
  fp32, bf16, fp16; torch's names as aliases), with one help text (`dtypes`);
- `fast_precision(accelerator)`: the training precision, Lightning's "bf16-mixed" or "32-true" (`dtypes`);
- the few-row layers' library and kernel by vendor and instruction set (`few_rows`).
`PIECES` names what `specdec bench cpu` measures on and off (`pieces_off`, or SPECDEC_CPU_OFF
for a whole run: `pieces`); `host_report()` says what this host uses.

Modules: `dtypes` (the dtype and precision rules, CPU flags), `few_rows` (the layers),
`few_rows_kernel` and `few_rows_panels` (numba's kernels), `pieces` (the pieces and turning one
off), `timing` (kernel timings for the bench).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import check
from . import few_rows
from .dtypes import (
    BF16_INSTRUCTIONS,
    COMPUTE_DTYPES,
    RULE_FLAGS,
    STORAGE_DTYPES,
    add_dtype_argument,
    cpu_flags,
    cpu_model,
    cpu_vendor,
    dtype_help,
    fast_dtype,
    fast_precision,
    parse_dtype,
    resolve_device,
    resolve_dtype,
)
from .pieces import PIECES, off, pieces_off


@dataclass
class Prepared:
    """What `prepare_for_device` did: the device, the dtype cast to (None: each model kept its
    own) and the linear layers it switched to few-row layers (`undo` switches them back)."""

    device: torch.device
    dtype: torch.dtype | None
    layers: list[nn.Module] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Switch back the layers switched (a cast or a move stays)."""
        few_rows.switch_back(self.layers)
        self.layers = []

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def prepare_for_device(models: nn.Module | Iterable[nn.Module | None], device: str | torch.device = "cpu",
                       dtype: str | torch.dtype | None = "auto") -> Prepared:
    """Ready `models` (a module or several; None entries are skipped) for decoding on `device`:
    moved there, cast to `dtype` ("auto", "float32", "bfloat16", a torch.dtype; None: no cast),
    and on a CPU their plain linear layers switched to few-row layers where these pay (module
    docstring). A bad device or dtype is a one-line SpecdecError before anything changes."""
    modules = [models] if isinstance(models, nn.Module) else [m for m in models if m is not None]
    check(all(isinstance(m, nn.Module) for m in modules),
          f"prepare_for_device takes torch modules, got {', '.join(type(m).__name__ for m in modules)}")
    device = resolve_device(device)
    dtype = None if dtype is None else resolve_dtype(dtype, device)
    pieces = off()
    for module in modules:
        if dtype is None:
            module.to(device)
        else:
            module.to(device=device, dtype=dtype)
    layers = few_rows.switch_layers(modules) if device.type == "cpu" and "linear" not in pieces else []
    return Prepared(device, dtype, layers)


def describe(device: str | torch.device, dtype: torch.dtype) -> str:
    """How `prepare_for_device` computes the linear layers of `dtype` models on `device`, in words
    (for reports)."""
    if torch.device(device).type != "cpu" or "linear" in off() or not few_rows.few_rows_pays("cpu", dtype):
        return "torch's own linear layers"
    return f"few-row linear layers ({few_rows.describe(dtype)})"


def host_pieces() -> dict[str, bool]:
    """Which of `PIECES` this host's rules use (the pieces turned off aside)."""
    library, kernel = few_rows.rule()
    return {"bf16": bool(BF16_INSTRUCTIONS & cpu_flags()), "linear": True, "mkl": library == "mkl",
            "dot": library == "onednn" and kernel == "numba",
            "panels": library == "onednn" and kernel == "panels"}


def host_report() -> dict[str, Any]:
    """This host as the corner sees it: the CPU, the flags its rules read that it has, the pieces
    it uses, the pieces off, and how each dtype's layers are computed."""
    return {"cpu": cpu_model() or "unknown", "vendor": cpu_vendor() or "unknown",
            "flags": [flag for flag in RULE_FLAGS if flag in cpu_flags()], "threads": torch.get_num_threads(),
            "jit": "numba " + ("installed" if few_rows.few_rows_kernel.available() else
                               "not installed: pip install 'specdec[fast]'"),
            "pieces_used": host_pieces(), "pieces_off": sorted(off()),
            "dtype": str(fast_dtype("cpu")).removeprefix("torch."), "precision": fast_precision("cpu"),
            "float32_layers": describe("cpu", torch.float32), "bfloat16_layers": describe("cpu", torch.bfloat16)}


def comparisons() -> list[tuple[str, tuple[torch.dtype, frozenset[str]], tuple[torch.dtype, frozenset[str]]]]:
    """What `specdec bench cpu` times to tell what each piece this host uses buys: (name, on,
    off), each setting a (dtype, pieces off) pair. Few-row layers in fp32 (and in bf16 where oneDNN
    runs it), each fp32 kernel the host's rule takes against what it would take without it, and
    the dtype rule: bf16 against fp32, each as `prepare_for_device` makes it."""
    fp32, bf16, none = torch.float32, torch.bfloat16, frozenset()
    used = host_pieces()
    found = [("linear float32", (fp32, none), (fp32, frozenset({"linear"})))]
    if few_rows.few_rows_pays("cpu", bf16):
        found.append(("linear bfloat16", (bf16, none), (bf16, frozenset({"linear"}))))
    found += [(piece, (fp32, none), (fp32, frozenset({piece}))) for piece in ("mkl", "panels", "dot") if used[piece]]
    found.append(("bf16", (bf16, none), (fp32, none)))
    return found


__all__ = ["COMPUTE_DTYPES", "PIECES", "Prepared", "STORAGE_DTYPES", "add_dtype_argument", "comparisons", "describe",
           "dtype_help", "fast_dtype", "fast_precision", "host_pieces", "host_report", "parse_dtype", "pieces_off",
           "prepare_for_device", "resolve_device", "resolve_dtype"]
