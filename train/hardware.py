"""Which training precision is fast on this machine: the `${fast_precision:ACCELERATOR}` resolver.

bf16-mixed autocasts the matmuls to bf16 (the weights stay fp32). Whether that is faster than fp32
depends on the hardware, and on a CPU it can be much slower. Measured on one eagle3 training step
at the SmolLM2 recipe's shapes (4 rows x 256 tokens, 4 unroll steps, the 8,192-row vocabulary,
forward, backward and AdamW on one thread; docs/cpu.md):
- on a host with AMX (inferred from its speed), bf16-mixed ran 1.8x the fp32 step rate;
- on an Intel Xeon with AVX-512 and its bf16 instructions but no AMX, it ran at 0.68x (2.88 s a
  step against 1.94 s);
- on an AMD EPYC (Zen 4) with AVX-512 and avx512_bf16, no AMX, it ran 1.76x (`python
  scripts/bench_train.py --eagle3-step`, 12 interleaved rounds: 1.244 s a step against 2.209 s,
  paired ratio 0.568). One-thread matmuls at the head's shapes ran
  184-207 GFLOP/s in bf16 there against 71-96 in fp32: Zen 4 executes a 512-bit fp32 FMA as two
  256-bit halves, while its bf16 dot product (vdpbf16ps) does twice the work per instruction.

AMX is what gives Intel CPUs their bf16 matmul speed (oneDNN's bf16 kernels use its tiles), so
`fast_precision("cpu")` returns "bf16-mixed" where /proc/cpuinfo lists `amx_bf16`, or lists
`avx512_bf16` on an AMD CPU (`vendor_id` AuthenticAMD), and "32-true" elsewhere. (Decoding and
caching have a rule of their own, `specdec_models.hardware.fast_dtype`: bf16 instructions of either
kind suffice there.) The earlier host's flags were not recorded: that it had AMX is the inference
from its speed, not a reading. On a CUDA device that supports bf16 it returns "bf16-mixed". The
rule reads flags, never a clock, so a config resolves the same way on one machine every time (a
timing probe would flip with the machine's load). On an AMD EPYC with AVX2 only the rule gives
32-true; bf16-mixed training was not timed there.
"""

from __future__ import annotations

import torch

from specdec_models.hardware import cpu_flags, cpu_vendor, cuda_device


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


__all__ = ["bf16_trains_fast_on_cpu", "cpu_flags", "fast_precision"]
