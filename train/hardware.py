"""Which training precision is fast on this machine: the `${fast_precision:ACCELERATOR}` resolver.

bf16-mixed autocasts the matmuls to bf16 (the weights stay fp32). Whether that is faster than fp32
depends on the hardware, and on a CPU it can be much slower. Measured on one eagle3 training step
at the SmolLM2 recipe's shapes (4 rows x 256 tokens, 4 unroll steps, the 8,192-row vocabulary,
forward, backward and AdamW on one thread; README, "The same recipe on a host without AMX"):
- on the host of the earlier rounds, bf16-mixed ran 1.8x the fp32 step rate;
- on an Intel Xeon with AVX-512 and its bf16 instructions but no AMX, it ran at 0.68x (2.88 s a
  step against 1.94 s).

AMX is the CPU feature that gives bf16 matmuls their speed (its tiles are what oneDNN's bf16
kernels use), so `fast_precision("cpu")` returns "bf16-mixed" where /proc/cpuinfo lists `amx_bf16`
and "32-true" elsewhere. (Decoding and caching have a rule of their own,
`specdec_models.hardware.fast_dtype`: bf16 instructions of either kind suffice there.) The earlier
host's flags were not recorded: that it had AMX is the inference from its speed, not a reading. On a CUDA device that supports bf16 it returns
"bf16-mixed". The rule reads flags, never a clock, so a config resolves the same way on one
machine every time (a timing probe would flip with the machine's load). On a third host, an AMD
EPYC with AVX2 only, the rule gives 32-true; bf16-mixed training was not timed there.
"""

from __future__ import annotations

import torch

from specdec_models.hardware import cpu_flags, cuda_device


def fast_precision(accelerator: str = "cpu") -> str:
    """Lightning's precision for the faster training on `accelerator` ("cpu", "gpu", "cuda" or
    "auto"): "bf16-mixed" on a CUDA device with bf16 and on a CPU with AMX, else "32-true"."""
    cuda = cuda_device(accelerator)
    if cuda:
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    return "bf16-mixed" if cuda is False and "amx_bf16" in cpu_flags() else "32-true"


__all__ = ["cpu_flags", "fast_precision"]
