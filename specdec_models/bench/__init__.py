"""Benchmark harnesses in pure PyTorch (the scripts under scripts/ are their command lines):
`bench.decode` (plain, draft and prophet decoding side by side, c and v measured inside the same
runs), `bench.peer` (lucidrains' speculative-decoding package at our sizes, for comparison),
`bench.train_step` (our train step against the peer's, interleaved), `bench.train_quality` (train
time to a fixed prophet acceptance) and `bench.report` (atomic JSON / markdown / PNG reports)."""
