"""Which dtype is fast on this machine: bf16 where the hardware has bf16 dot-product instructions.

bf16 halves the bytes a matmul reads, but only hardware with bf16 instructions also computes it
fast. Elsewhere a bf16 matmul is converted and computed slowly, which a 1-token decoding step
hides (it is bound by reading the weights) and every call on many tokens shows: a verify, a tree,
a batch of rows being generated. Measured on SmolLM2-135M, 2 CPU threads
(docs/cpu.md):
- a host with AMX (inferred from its speed; flags not recorded): bf16 decoded a step in 22.7 ms
  against 43.6 in fp32,
  a 6-token verify cost 1.10 steps, and bf16 generated a cache 1.6-1.8x as fast;
- an Intel Xeon with AVX-512 and its bf16 instructions (avx512_bf16) but no AMX: a bf16 verify
  of 5 / 28 tokens cost 1.34 / 2.52 steps; the eagle3 tree decoded text at 34.1 tokens/s in
  bf16 against 29.8 in fp32 (open prompts: 29.7 against 28.9), and bf16 and fp32 generated a
  cache alike (fp32 plain decoding was the faster plain decoding there, 33.8 against 39.5 ms);
- an AMD EPYC with AVX2 only: a verify of 5 / 28 tokens cost 2.31 / 9.20 bf16 steps against
  1.52 / 2.03 fp32 steps, so in bf16 every drafted method ran slower than plain decoding
  (0.58-0.73x), in fp32 the tree did not (plain decoding alone was faster in bf16 there: 65
  against 88 ms a token); with few-row fp32 layers (`few_rows.py`) a drafted fp32 decoding ran
  1.24-1.31x as fast as plain bf16 decoding there;
- an AMD EPYC with AVX-512 and avx512_bf16, no AMX: a bf16 step took 46.4 ms, a few-row fp32 step
  (numba) 38.4, a bf16 verify of 16 tokens 62.3 against fp32's 99.7; bf16 generated the cache at
  500-800 tokens/s, and a bf16 tree was the fastest drafting at T=0 in 8-prompt comparisons,
  while fp32 plain decoding beat bf16's (`racing_dtype` below). With bf16 weights packed once for
  oneDNN (`few_rows.py`) a bf16 step costs about a numba fp32 step (0.80-0.86 of an unpacked
  bf16 step, both) and a bf16 verify of 8 tokens 0.91-0.98 against fp32's 1.32-1.33: the two plain
  decodings came within a few percent of each other, the faster one either dtype by cell.

So `fast_dtype("cpu")`, the dtype decoding and caching run in by default ("auto"), is bf16 where
/proc/cpuinfo lists `avx512_bf16` or `amx_bf16` and fp32 elsewhere; on a CUDA device, bf16
where it is supported. The rule reads flags, never a clock, so one machine always answers the
same (a timing probe would flip with the machine's load). Training has its own rule
(`train.hardware.fast_precision`: bf16-mixed with AMX, or with avx512_bf16 on an AMD CPU; a
training step in bf16 autocast ran 0.68x fp32's speed on the Xeon above, 1.76x on the EPYC with
avx512_bf16).
"""

from __future__ import annotations

import os

import torch

_CPUINFO = "/proc/cpuinfo"


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


BF16_INSTRUCTIONS = frozenset({"avx512_bf16", "amx_bf16"})      # bf16 dot products on a CPU


def cuda_device(device: str | torch.device) -> bool | None:
    """For `device` ("cpu", "cuda", "cuda:1", or "gpu"/"auto" as Lightning names accelerators):
    True for a CUDA device that is there, False for the CPU, None for "gpu" without CUDA."""
    name = str(device).lower()
    if name in ("gpu", "auto"):
        return True if torch.cuda.is_available() else (False if name == "auto" else None)
    return torch.device(name).type == "cuda" and torch.cuda.is_available()


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype decoding and caching run faster in on `device` (module docstring): torch.bfloat16
    on a CUDA device that supports it or a CPU with bf16 instructions, else torch.float32."""
    cuda = cuda_device(device)
    if cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cuda is False and BF16_INSTRUCTIONS & cpu_flags() else torch.float32


def racing_dtype(device: str | torch.device = "cpu") -> torch.dtype | None:
    """The dtype whose plain decoding may beat `fast_dtype(device)`'s on `device`, else None:
    - fp32 on a CPU with bf16 dot products but no AMX. There bf16 verifies many tokens cheaply (a
      tree), while a 1-token fp32 step with few-row layers is the faster plain decoding: on an AMD
      EPYC with avx512_bf16 (interleaved, 200 cached tokens) a bf16 step took 46.4 ms, a numba
      few-row fp32 step 38.4; fp32 plain decoding ran 1.16-1.36x bf16's, and in two 8-prompt
      comparisons a bf16 tree was the fastest drafting at T=0 (tied once with the fp32 tree) while
      fp32 chains beat bf16's. With bf16 weights
      packed for oneDNN the two plain decodings came within a few percent, either the faster by
      cell, so the race stays. Both dtypes' drafters race there (`race_drafters`).
    - bf16 on a CPU without bf16 instructions (its flags known): a 1-token step reads half the
      bytes in bf16, while every call on many tokens is dearer, so only bf16's plain decoding races
      the fp32 drafters. On an AMD EPYC with AVX2 only (Zen 3; `scripts/bench_hf.py
      --verify-cost 4 8 16 --few-rows --dtype float32 --also-dtype bfloat16`), in units of an fp32
      1-token step with torch's layers: a bf16 step with packed weights 0.60-0.67, a numba few-row
      fp32 step 0.69-0.75, while a bf16 call on 8 tokens cost 2.1-2.3 against fp32's 1.0-1.1.
    With AMX a bf16 step costs half an fp32 one, and on a CUDA device bf16 is the faster: no race. A
    comparison where the dtypes race (`compare_hf_drafts.py --also-dtype`) reports speed-ups over the
    faster plain decoding."""
    if cuda_device(device) is not False:
        return None
    flags = cpu_flags()
    if not flags:
        return None
    if not BF16_INSTRUCTIONS & flags:
        return torch.bfloat16
    return torch.float32 if "amx_bf16" not in flags else None


def race_drafters(device: str | torch.device = "cpu") -> bool:
    """Whether the drafters race in `racing_dtype(device)` too, or only its plain decoding: they do
    in fp32 beside bf16 instructions (few-row fp32 chains can beat bf16's), not in bf16 without them
    (a bf16 verify of 8 tokens cost 2.1-2.3 fp32 steps on an AVX2 EPYC: no draft pays)."""
    return racing_dtype(device) == torch.float32


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype named on a command line: "bfloat16", "float32", or "auto" (`fast_dtype(device)`)."""
    return fast_dtype(device) if name == "auto" else getattr(torch, name)


__all__ = ["BF16_INSTRUCTIONS", "cpu_flags", "cpu_vendor", "cuda_device", "fast_dtype", "race_drafters", "racing_dtype",
           "resolve_dtype"]
