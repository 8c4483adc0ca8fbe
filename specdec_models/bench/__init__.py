"""Benchmark harnesses in pure PyTorch (the scripts under scripts/ are their command lines):
`bench.decode` (plain, draft and prophet decoding side by side, c and v measured inside the same
runs) and `bench.peer` (lucidrains' speculative-decoding package at our sizes, for comparison)."""
