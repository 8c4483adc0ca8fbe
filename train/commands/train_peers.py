"""Run the peer trainers (the EAGLE-3 trainers of vLLM's speculators and SpecForge) live, on specdec's cache.

    specdec peers --cache CACHE_DIR --draft-vocab COUNTS.json --minutes 10 --threads 1 --out DIR

For the same data, wall time and threads as specdec's eagle3 head (task=hf_eagle3 on the same
cache and token counts):
1. the target (`--target`, default the model cache.json names; its weights must be the cache's)
   is written as a Hugging Face model directory DIR/verifier, which the peers read their
   verifier's embedding, final norm and LM head from;
2. the cache (made with `--layers A,B,C,L`) is converted to each peer's offline data
   (`train.data.peer_formats`: DIR/data/<peer>), and the draft vocabulary (the `--draft-vocab-size`
   tokens most counted in COUNTS.json, as specdec chooses them; without COUNTS.json the whole
   vocabulary) into each peer's vocabulary-mapping files;
3. each peer's trainer (`--peers`, default both: speculators, then SpecForge) runs in its own
   process in the interop environment (`--python`, default .venv-interop: `make setup-interop`),
   patched at run time (scripts/peers/run_<peer>.py), for `--minutes` of training (or
   `--max-steps`), on `--threads` threads; the peers run one after the other, so neither
   competes with the other for the CPU; its head lands in DIR/<peer>/head (SpecForge's in the
   SGLang layout its own exporter writes);
4. each head is loaded into specdec (`load_eagle3(DIR/<peer>/head, target)`) and drafts a few
   tokens, so `specdec evaluate --head NAME=DIR/<peer>/head ...`
   and `specdec decode --eagle3 DIR/<peer>/head ...` take it.

DIR/peers.json collects each peer's report: steps, tokens trained on, training seconds and
throughput (tokens/s: every position of the packed rows; answer_tokens/s: those with a label),
the head's path and what loading it in specdec found. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specdec_models.cli_args import Parser, comma_list
from specdec_models.errors import check, cli_main, prog
from specdec_models.files import check_output, mark_dir

REPO = Path(__file__).resolve().parents[2]
PEERS = ("speculators", "specforge")
KIND = "peer runs"          # the folder kind of --out (`specdec_models.files.mark_dir`)
RUNNERS = {peer: REPO / "scripts" / "peers" / f"run_{peer}.py" for peer in PEERS}   # run by path, in --python


def parse(argv: list[str] | None) -> argparse.Namespace:
    from specdec_models.cpu import add_dtype_argument

    p = Parser(prog=prog("specdec peers"), description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True, help="specdec's embeddings cache, made with --layers A,B,C,L")
    p.add_argument("--draft-vocab", help="token counts (specdec draft-vocab); none: the whole vocabulary")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="the head's draft vocabulary: the most counted tokens of --draft-vocab")
    p.add_argument("--target", help="the cache's target (GGUF file or model directory); default: cache.json's")
    p.add_argument("--out", required=True,
                   help="the folder written")
    p.add_argument("--peers", type=comma_list(str, "--peers", choices=PEERS), default=list(PEERS),
                   help="the peers trained, comma-separated")
    p.add_argument("--minutes", type=float, help="training wall time per peer")
    p.add_argument("--max-steps", type=int, help="optimizer steps per peer (tests, smoke runs)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default %(default)s; none: torch's)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training (speculators' default)")
    p.add_argument("--rows", type=int, help="convert only the cache's first ROWS rows")
    add_dtype_argument(p, "--data-dtype", default="bf16", allowed=("bf16", "fp32"),
                       what="hidden states in speculators' data files (SpecForge's: the draft's fp32, its target "
                            "head's bf16)")
    p.add_argument("--python", default=str(REPO / ".venv-interop" / "bin" / "python"),
                   help="the interpreter with the peers' packages (make setup-interop)")
    p.add_argument("--force", action="store_true",
                   help="write into an OUT that holds files specdec did not write as peer runs")
    a = p.parse_args(argv)
    if a.minutes is None and a.max_steps is None:
        p.error("give --minutes (a budget per peer) or --max-steps")
    return a


def verifier_dir(model, tokenizer, out: Path) -> Path:
    """The target as a Hugging Face model directory: config.json, model.safetensors (its weights as
    loaded, fp32; a GGUF target's dequantized ones, which `save_pretrained` refuses to write) and
    its tokenizer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # tied weights share storage, which safetensors refuses: each tensor is written on its own
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    return out


def mask_token_id(tokenizer) -> int:
    """The id speculators' eagle3 config asks for (unused by its eagle3 loss): the tokenizer's
    mask, pad or end-of-sequence token, as speculators' own fallback picks it."""
    for name in ("mask_token_id", "pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def run_peer(peer: str, a: argparse.Namespace, data: Path, verifier: Path, aux: list[int], vocab: dict | None,
             mask_id: int, out: Path) -> dict:
    """One peer's trainer in its own process; its report."""
    cmd = [a.python, str(RUNNERS[peer]), "--data", str(data), "--verifier", str(verifier), "--out", str(out),
           "--threads", str(a.threads), "--ttt-steps", str(a.ttt_steps)]
    if peer == "speculators":
        cmd += ["--aux-layers", *map(str, aux), "--mask-token-id", str(mask_id)]
        if vocab is not None:
            cmd += ["--draft-vocab-size", str(vocab["size"]), "--d2t", str(vocab["d2t"]), "--t2d", str(vocab["t2d"])]
    else:
        cmd += ["--aux-layers", *map(str, aux)]
        if vocab is not None:
            cmd += ["--draft-vocab-size", str(vocab["size"]), "--vocab-mapping", str(vocab["specforge"])]
    if a.minutes is not None:
        cmd += ["--minutes", str(a.minutes)]
    if a.max_steps is not None:
        cmd += ["--max-steps", str(a.max_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads), "TQDM_DISABLE": "1",
           "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as log:
        status = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    check(status == 0 and (out / "report.json").is_file(),
          f"{peer}'s trainer failed (exit {status}): see {out / 'train.log'}")
    report = json.loads((out / "report.json").read_text())
    report["process_seconds"] = round(time.perf_counter() - t0, 1)
    return report


def check_head(head: Path, model, tokenizer) -> dict:
    """Load a peer's head into specdec and draft with it: the layout, the draft vocabulary, and
    that speculative greedy decoding equals plain greedy decoding (it must, whatever the head)."""
    import torch

    from specdec_models.decode import GREEDY, HeadDrafter, generate
    from specdec_models.export.eagle3 import detect_layout, load_eagle3

    loaded = load_eagle3(head, model)
    prompt = torch.tensor(tokenizer("The")["input_ids"] or [0])
    plain, _ = generate(model, [prompt], 8, sampling=GREEDY)
    drafted, stats = generate(model, [prompt], 8, HeadDrafter(loaded), sampling=GREEDY, gamma=3)
    check(drafted[0].tolist() == plain[0].tolist(), f"{head}: greedy decoding with the head differs from plain greedy")
    return {"layout": detect_layout(head), "aux_layers": loaded.aux_layers,
            "draft_vocab_size": loaded.config.draft_vocab_size, "drafted": int(stats.drafted),
            "accepted": int(stats.accepted)}


def train_peers(a: argparse.Namespace) -> dict:
    import torch

    from specdec_models.heads.eagle3 import _final_norm_weight, choose_draft_vocab
    from specdec_models.hf import logits_width
    from specdec_models.hf.weights import load_model, weights_sha256
    from train.data.embeddings_cache import check_cache, read_cache_meta
    from train.data.peer_formats import cache_layout, to_specforge, to_speculators, vocab_files
    from train.tasks.hf_eagle3 import read_token_counts

    out = Path(a.out).expanduser()
    check_output(out, "--out", kind=KIND, force=a.force, inputs=[a.cache, a.target, a.draft_vocab, a.python],
                 force_does="write into it", records=["peers.json"])
    check(a.threads >= 1, f"--threads must be >= 1, got {a.threads}")
    check(Path(a.python).is_file(), f"--python {a.python} does not exist: make setup-interop creates it")
    meta = read_cache_meta(a.cache)
    aux, _ = cache_layout(meta)
    target = a.target or meta["model"]["path"]
    torch.set_num_threads(a.threads)
    model, tokenizer, _ = load_model(target)
    check_cache(a.cache, weights_sha256=weights_sha256(model), model=f"the target {target}")
    vocab_size = logits_width(model)
    vocab = None
    if a.draft_vocab is not None and a.draft_vocab_size < vocab_size:
        counts = read_token_counts(a.draft_vocab, tokenizer, meta["vocab_size"])
        ids = choose_draft_vocab(counts, a.draft_vocab_size)
        vocab = {"size": a.draft_vocab_size, **vocab_files(ids, vocab_size, out / "data" / "vocab")}
    out.mkdir(parents=True, exist_ok=True)
    mark_dir(out, KIND)
    verifier = verifier_dir(model, tokenizer, out / "verifier")
    dtype = getattr(torch, a.data_dtype)
    data, converted = {}, {}
    for peer in a.peers:
        data[peer] = out / "data" / peer
        if peer == "speculators":
            norm = _final_norm_weight(model)
            check(norm is not None, f"cannot find the final norm of {type(model).__name__}")
            converted[peer] = to_speculators(a.cache, data[peer], norm, rows=a.rows, dtype=dtype)
        else:
            converted[peer] = to_specforge(a.cache, data[peer], rows=a.rows)     # its draft trains in fp32
        print(f"{peer}: converted {converted[peer]['rows']} rows ({converted[peer]['tokens']:,} tokens) to "
              f"{data[peer]}", flush=True)
    summary = {"cache": str(Path(a.cache).resolve()), "target": str(target), "aux_layers": aux,
               "draft_vocab_size": vocab["size"] if vocab else vocab_size, "minutes": a.minutes,
               "max_steps": a.max_steps, "threads": a.threads, "ttt_steps": a.ttt_steps, "peers": {}}
    for peer in a.peers:
        report = run_peer(peer, a, data[peer], verifier, aux, vocab, mask_token_id(tokenizer), out / peer)
        report["data"] = converted[peer]
        report["in_specdec"] = check_head(Path(report["head"]), model, tokenizer)
        summary["peers"][peer] = report
        print(f"{peer}: {report['steps']} steps in {report['train_seconds']:.0f} s, "
              f"{report['tokens_per_s']} tokens/s; head {report['head']}", flush=True)
    (out / "peers.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


@cli_main
def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    train_peers(a)
    print(f"report: {Path(a.out) / 'peers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
