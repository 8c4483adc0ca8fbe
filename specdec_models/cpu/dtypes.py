"""Which dtype is fast on this machine: bf16 where the hardware has bf16 dot-product instructions.

bf16 halves the bytes a matmul reads, but only hardware with bf16 instructions also computes it
fast. Elsewhere a bf16 matmul is converted and computed slowly, which a 1-token decoding step
hides (it is bound by reading the weights) and every call on many tokens shows: a verify, a tree,
a batch of rows being generated (the timings per host class: docs/cpu.md).

So `fast_dtype("cpu")`, the dtype decoding and caching run in by default ("auto"), is bf16 where
/proc/cpuinfo lists `avx512_bf16` or `amx_bf16` and fp32 elsewhere; on a CUDA device, bf16
where it is supported; on Apple's MPS, fp32 (its bf16 depends on the macOS version). The rule
reads flags, never a clock, so one machine always answers the same (a timing probe would flip
with the machine's load).

Training has its own rule, `fast_precision(accelerator)` (Lightning's precision, the
`${fast_precision:...}` resolver of train/__init__.py): bf16-mixed autocasts the matmuls to bf16
(the weights stay fp32), which on a CPU can be much slower than fp32. AMX is what gives Intel CPUs
their bf16 matmul speed (oneDNN's bf16 kernels use its tiles), and Zen 4 executes a 512-bit fp32
FMA as two 256-bit halves while its bf16 dot product does twice the work per instruction, so
`fast_precision("cpu")` is "bf16-mixed" where /proc/cpuinfo lists `amx_bf16`, or lists
`avx512_bf16` on an AMD CPU (`vendor_id` AuthenticAMD), and "32-true" elsewhere; on a CUDA device
with bf16, "bf16-mixed" (the training-step timings: docs/cpu.md).

Every command line names a dtype the same way (`parse_dtype`, `add_dtype_argument`): `auto`,
`fp32`, `bf16`, `fp16`, with torch's names `float32`, `bfloat16`, `float16` accepted as aliases
(the names earlier commands used); a storage dtype (an embeddings cache's) takes the same names
plus `int8`. The parsed value is torch's name, what configs and file metadata hold.
"""

from __future__ import annotations

import argparse
import os

import torch

from ..errors import SpecdecError, check
from .pieces import off

_CPUINFO = "/proc/cpuinfo"
DEVICES = ("cpu", "cuda", "mps")


def _first_cpu(path: str | os.PathLike | None = None) -> dict[str, str]:
    """The fields of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        with open(path or _CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep and fields:                     # the blank line after the first CPU
                    break
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags(path: str | os.PathLike | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    return frozenset(_first_cpu(path).get("flags", "").split())


def cpu_vendor(path: str | os.PathLike | None = None) -> str:
    """The first CPU's `vendor_id` in /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"; "" where unknown)."""
    return _first_cpu(path).get("vendor_id", "")


def cpu_model(path: str | os.PathLike | None = None) -> str:
    """The first CPU's `model name` in /proc/cpuinfo ("" where unknown)."""
    return _first_cpu(path).get("model name", "")


BF16_INSTRUCTIONS = frozenset({"avx512_bf16", "amx_bf16"})      # bf16 dot products on a CPU
# the flags the corner's rules read (reports name these)
RULE_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cuda_device(device: str | torch.device) -> bool | None:
    """For `device` ("cpu", "cuda", "cuda:1", or "gpu"/"auto" as Lightning names accelerators):
    True for a CUDA device that is there, False for the CPU, None for "gpu" without CUDA."""
    name = str(device).lower()
    if name in ("gpu", "auto"):
        return True if torch.cuda.is_available() else (False if name == "auto" else None)
    return torch.device(name).type == "cuda" and torch.cuda.is_available()


def resolve_device(name: str | torch.device, what: str = "device") -> torch.device:
    """The torch device `name` names ("cpu", "cuda", "cuda:1", "mps"), checked to be on this
    machine: a one-line SpecdecError naming `what` (e.g. "--device") for a name torch does not
    know, another kind, or a device that is not here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise SpecdecError(f"{what} {name!r} is not a torch device ({', '.join(DEVICES)}, cuda:N)") from None
    check(device.type in DEVICES, f"{what} {name!r}: decoding runs on {', '.join(DEVICES)}")
    if device.type == "cuda":
        check(torch.cuda.is_available(), f"{what} {name}: no CUDA device is available here")
        count = torch.cuda.device_count()
        check(device.index is None or device.index < count,
              f"{what} {name}: this machine has {count} CUDA device{'s' * (count != 1)} (cuda:0..cuda:{count - 1})")
    if device.type == "mps":
        check(torch.backends.mps.is_available(), f"{what} {name}: no Apple MPS device is available here")
    check(device.type != "cpu" or device.index in (None, 0), f"{what} {name}: the CPU is cpu")
    return device


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype decoding and caching run faster in on `device` (module docstring): torch.bfloat16
    on a CUDA device that supports it or a CPU with bf16 instructions (unless a benchmark turned
    the piece "bf16" off: `pieces`), else torch.float32."""
    if str(device).lower().startswith("mps"):
        return torch.float32
    cuda = cuda_device(device)
    if cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    bf16 = cuda is False and BF16_INSTRUCTIONS & cpu_flags() and "bf16" not in off()
    return torch.bfloat16 if bf16 else torch.float32


def bf16_trains_fast_on_cpu() -> bool:
    """Whether bf16 autocast trains faster than fp32 on this CPU (module docstring): with AMX, or
    with avx512_bf16 on an AMD CPU."""
    flags = cpu_flags()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and cpu_vendor() == "AuthenticAMD")


def fast_precision(accelerator: str = "cpu") -> str:
    """Lightning's precision for the faster training on `accelerator` ("cpu", "gpu", "cuda" or
    "auto"): "bf16-mixed" on a CUDA device with bf16 and on a CPU where `bf16_trains_fast_on_cpu`,
    else "32-true"."""
    cuda = cuda_device(accelerator)
    if cuda:
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if cuda is False and bf16_trains_fast_on_cpu() else "32-true"


# ------------------------------------------------------------------------------ the command lines' dtype names

# the short names every --dtype takes -> torch's name (what configs and file metadata hold)
DTYPE_NAMES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}     # torch's names, accepted too
COMPUTE_DTYPES = ("auto", "fp32", "bf16", "fp16")     # what models run in
STORAGE_DTYPES = ("bf16", "fp16", "int8")             # what an embeddings cache stores
AUTO = "auto: bf16 where --device computes it fast (a CUDA device with bf16, a CPU with bf16 instructions), else fp32"


def parse_dtype(text: str, allowed: tuple[str, ...] = COMPUTE_DTYPES, what: str = "--dtype") -> str:
    """Torch's name ("float32", "bfloat16", "float16", "int8") or "auto" of the dtype `text` names:
    one of `allowed` (short names) or its alias (torch's name); one line naming `what` otherwise."""
    short = DTYPE_ALIASES.get(text, text)
    aliases = [long for long, s in DTYPE_ALIASES.items() if s in allowed]
    check(short in allowed, f"{what} must be one of {', '.join(allowed)} (or {', '.join(aliases)}), got {text!r}")
    return DTYPE_NAMES[short]


def dtype_help(allowed: tuple[str, ...] = COMPUTE_DTYPES, default: str | None = "auto") -> str:
    """The one help text of a dtype flag taking `allowed`."""
    aliases = [long for long, s in DTYPE_ALIASES.items() if s in allowed]
    text = f"{' | '.join(allowed)} ({', '.join(aliases)} also accepted)"
    text += f"; {AUTO}" if "auto" in allowed else ""
    return text + (f" (default {default})" if default is not None else "")


def add_dtype_argument(parser: argparse.ArgumentParser, flag: str = "--dtype", *, default: str = "auto",
                       allowed: tuple[str, ...] = COMPUTE_DTYPES, what: str = "") -> argparse.Action:
    """Add `flag` to `parser`: a dtype of `allowed` parsed by `parse_dtype` (its value torch's name),
    `what` (the flag's meaning in this command) before the one help text. A bad name is the
    parser's error: one line where the parser makes its errors one line."""

    def dtype(text: str) -> str:
        try:
            return parse_dtype(text, allowed, flag)
        except SpecdecError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parser.add_argument(flag, type=dtype, default=default, metavar="|".join(allowed),
                               help=(f"{what}: " if what else "") + dtype_help(allowed, default))


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype a command computes in: a name `parse_dtype` takes ("auto" is
    `fast_dtype(device)`); float16 only on a CUDA device (a CPU computes it slowly, and the CPU
    corner's kernels have none); a torch.dtype is taken as given."""
    if isinstance(name, torch.dtype):
        return name
    name = parse_dtype(name, COMPUTE_DTYPES, "the dtype")
    check(name != "float16" or str(device).lower().startswith("cuda"),
          f"float16 on {device}: the dtype must be auto, bfloat16 or float32 there (fp16 only on a CUDA device)")
    return fast_dtype(device) if name == "auto" else getattr(torch, name)


__all__ = ["BF16_INSTRUCTIONS", "COMPUTE_DTYPES", "DTYPE_ALIASES", "DTYPE_NAMES", "RULE_FLAGS", "STORAGE_DTYPES",
           "add_dtype_argument", "bf16_trains_fast_on_cpu", "cpu_flags", "cpu_model", "cpu_vendor", "cuda_device",
           "dtype_help", "fast_dtype", "fast_precision", "parse_dtype", "resolve_device", "resolve_dtype"]
