"""`lorafleet generate [--adapter ID] [--max-new-tokens N] [--temperature T] ... "prompt"`:
streams a generation from the inference service to the terminal."""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc

from lorafleet.cli import connect
from lorafleet.cli.errors import report_rpc_error as report

INFERENCE_ENV = "LORAFLEET_INFERENCE"
DEFAULT_INFERENCE = "localhost:50052"

_FINISH = {1: "length", 2: "stop", 3: "eos"}


def inference_address_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get(INFERENCE_ENV, DEFAULT_INFERENCE),
        help=f"inference service address HOST:PORT (default ${INFERENCE_ENV} or "
        f"{DEFAULT_INFERENCE})",
    )
    connect.add_arguments(parser)


def report_rpc_error(exc: grpc.RpcError, server: str) -> None:
    """One line that says what went wrong and, where it helps, what to do."""
    report(exc, "inference service", server, "--server", INFERENCE_ENV)
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        print("lorafleet: `lorafleet adapters list` shows the adapters there are", file=sys.stderr)


def request_from_args(args: argparse.Namespace):
    from lorafleet.v1 import inference_pb2 as pb

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = pb.SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
    )
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    return pb.GenerateRequest(
        request_id=args.request_id,
        adapter_id=args.adapter,
        adapter_version=args.adapter_version,
        prompt=prompt,
        sampling=sampling,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from lorafleet.v1 import inference_pb2_grpc as pb_grpc

    request = request_from_args(args)
    start = time.perf_counter()
    first = None
    last = None
    try:
        with connect.channel(args.server, args) as channel:
            stub = pb_grpc.InferenceStub(channel)
            calls = stub.Generate(request, timeout=args.timeout, metadata=connect.metadata(args))
            for msg in calls:
                if first is None:
                    first = time.perf_counter() - start
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                last = msg
    except grpc.RpcError as exc:
        if last is not None:
            sys.stdout.write("\n")
        report_rpc_error(exc, args.server)
        return 1
    except connect.ConnectFlagError as exc:
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # leaving the stream cancels the request on the server
        sys.stdout.write("\n")
        return 130
    sys.stdout.write("\n")
    if not args.quiet and last is not None:
        total = time.perf_counter() - start
        tokens = last.usage.completion_tokens
        adapter = f"{args.adapter} v{last.adapter_version}" if args.adapter else "base model"
        print(
            f"[{adapter}: {tokens} tokens, finish {_FINISH.get(last.finish_reason, '?')}, "
            f"first token {first * 1000:.0f} ms, {tokens / max(total, 1e-9):.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "generate",
        help="stream a completion from the inference service",
        description="Stream a completion of PROMPT, from the base model or a LoRA adapter.",
        epilog='example: lorafleet generate --adapter acme/support-bot --max-new-tokens 64 "Hello"',
    )
    inference_address_argument(parser)
    parser.add_argument("prompt", help='the prompt text ("-" reads it from stdin)')
    parser.add_argument("--adapter", default="", help="adapter id (default: the base model)")
    parser.add_argument(
        "--adapter-version", type=int, default=0, help="adapter version (default: the latest)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling, (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="0 (the default) is off")
    parser.add_argument("--seed", type=int, default=None, help="reproducible sampling")
    parser.add_argument(
        "--stop", action="append", default=[], help="stop before this string (repeatable)"
    )
    parser.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    parser.add_argument("--request-id", default="", help="default: one the server generates")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    parser.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    parser.set_defaults(handler=cmd_generate)
