"""The `specdec` command's verbs, one module each (train/cli.py runs them in-process).

Each module has `main(argv=None) -> int` under `specdec_models.errors.cli_main` (bad input: one
line, exit 2, before any work) and runs as `python -m train.commands.NAME` too. The journey's
verbs: eagle3 (the recipe), evaluate, export, export_head (`specdec export-head` and
`specdec export-eagle3`), cache_embeddings (`specdec cache`),
draft_vocab; the tools: make_prompts, train_peers, plot_runs, scale_plan; the developer tools of
`specdec bench NAME`: bench_*, acceptance, compare_*. specdec eagle3, specdec evaluate and
specdec bench answers are aliases of theirs, kept for the tools that call them by path.
"""
