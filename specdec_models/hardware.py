"""Which dtype is fast on this machine: bf16 where the hardware multiplies bf16 matrices natively.

bf16 halves the bytes a matmul reads, but only hardware with bf16 matrix instructions also
computes it fast. Elsewhere a bf16 matmul is converted and computed slowly, which a 1-token
decoding step hides (it is bound by reading the weights) and every call on many tokens shows (a
verify, a tree, a batch of rows being generated). Measured on SmolLM2-135M, 2 CPU threads
(README, "Which dtype, on which host"):
- a host with AMX (the earlier rounds' host): bf16 decoded a step in 22.7 ms against 43.6 in fp32,
  a 6-token verify cost 1.10 steps, and bf16 generated a cache 1.6-1.8x as fast;
- an Intel Xeon with AVX-512 and its bf16 instructions but no AMX: fp32 decoded a step faster
  (33.8 against 39.5 ms), a bf16 verify of 5 / 28 tokens cost 1.34 / 2.52 steps, and bf16 and
  fp32 generated a cache alike;
- an AMD EPYC with AVX2 only: bf16 decoded a step faster (65 against 88 ms), but a verify of 5 /
  28 tokens cost 2.31 / 9.20 bf16 steps against 1.52 / 2.03 fp32 steps, so every drafted method
  ran slower than plain decoding in bf16.

So `fast_dtype("cpu")` is bf16 where /proc/cpuinfo lists `amx_bf16` and fp32 elsewhere, and on a
CUDA device bf16 where it is supported. The rule reads flags, never a clock, so one machine always
answers the same (a timing probe would flip with the machine's load). `train.hardware` derives
the training precision from the same rule.
"""

from __future__ import annotations

import os

import torch

_CPUINFO = "/proc/cpuinfo"


def cpu_flags(path: str | os.PathLike | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    try:
        with open(path or _CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def fast_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether `device` ("cpu", "cuda", "cuda:1", or "gpu"/"auto" as Lightning names accelerators:
    a CUDA device when there is one) multiplies bf16 matrices natively: a CUDA device that supports
    bf16, or a CPU with AMX."""
    name = str(device).lower()
    if name in ("gpu", "auto"):
        if torch.cuda.is_available():
            return torch.cuda.is_bf16_supported()
        return name == "auto" and "amx_bf16" in cpu_flags()
    if torch.device(name).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "amx_bf16" in cpu_flags()


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """torch.bfloat16 where `device` multiplies bf16 natively (`fast_bf16`), else torch.float32."""
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype named on a command line: "bfloat16", "float32", or "auto" (`fast_dtype(device)`)."""
    return fast_dtype(device) if name == "auto" else getattr(torch, name)


__all__ = ["cpu_flags", "fast_bf16", "fast_dtype", "resolve_dtype"]
