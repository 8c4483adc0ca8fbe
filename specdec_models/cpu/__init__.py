"""The CPU corner: what tunes decoding for the CPU it runs on (few-row linear layers and their
numba / LLVM kernels, the dtype rules from the CPU's flags)."""

from .dtypes import fast_dtype, fast_precision, resolve_dtype

__all__ = ["fast_dtype", "fast_precision", "resolve_dtype"]
