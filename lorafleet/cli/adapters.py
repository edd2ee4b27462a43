"""`lorafleet adapters upload DIR --id ID | list | info ID | delete ID`: the adapter store's CLI."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc

from lorafleet.cli import connect
from lorafleet.cli.errors import report_rpc_error
from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc

STORE_ENV = "LORAFLEET_ADAPTER_STORE"
DEFAULT_STORE = "localhost:50051"
DEFAULT_CHUNK_BYTES = 1 << 20
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class CliError(Exception):
    """A mistake the person at the terminal can fix; the message says how."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def adapter_files(directory: Path) -> tuple[str, Path]:
    """adapter_config.json's text and the weights' path, from a PEFT save_pretrained dir."""
    if not directory.is_dir():
        raise CliError(f"{directory} is not a directory (give the one save_pretrained wrote)")
    config, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config, weights):
        if not path.is_file():
            hint = " (re-save .bin files with safe_serialization=True)" if path == weights else ""
            raise CliError(f"{directory} has no {path.name}{hint}")
    return config.read_text(encoding="utf-8"), weights


def upload_requests(
    adapter_id: str,
    directory: Path,
    description: str = "",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[pb.UploadAdapterRequest]:
    """The UploadAdapter stream for a PEFT adapter directory: header, then the weights read
    from disk chunk by chunk (never whole in memory)."""
    config_json, weights = adapter_files(directory)
    yield pb.UploadAdapterRequest(
        header=pb.UploadAdapterHeader(
            adapter_id=adapter_id,
            adapter_config_json=config_json,
            sha256=file_sha256(weights),
            description=description,
            size_bytes=weights.stat().st_size,
        )
    )
    with open(weights, "rb") as f:
        while chunk := f.read(chunk_bytes):
            yield pb.UploadAdapterRequest(chunk=chunk)
            if on_progress is not None:
                on_progress(len(chunk))


def _stub(args: argparse.Namespace) -> pb_grpc.AdapterStoreStub:
    return pb_grpc.AdapterStoreStub(connect.channel(args.store, args))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _created(info: pb.AdapterInfo) -> str:
    return datetime.fromtimestamp(info.created_at.ToNanoseconds() / 1e9, UTC).strftime(
        "%Y-%m-%d %H:%M:%S"
    )


def _info_dict(info: pb.AdapterInfo) -> dict:
    return {
        "adapter_id": info.adapter_id,
        "version": info.version,
        "rank": info.rank,
        "lora_alpha": info.lora_alpha,
        "target_modules": list(info.target_modules),
        "num_layers": info.num_layers,
        "dtype": info.dtype,
        "size_bytes": info.size_bytes,
        "sha256": info.sha256,
        "created_at": _created(info) + " UTC",
        "description": info.description,
    }


def cmd_upload(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    directory = Path(args.dir)
    _, weights = adapter_files(directory)
    with tqdm(
        total=weights.stat().st_size,
        unit="B",
        unit_scale=True,
        desc=f"uploading {args.id}",
        disable=args.quiet,
        file=sys.stderr,
    ) as bar:
        requests = upload_requests(args.id, directory, args.description, on_progress=bar.update)
        info = _stub(args).UploadAdapter(
            requests, timeout=args.timeout, metadata=connect.metadata(args)
        )
    print(f"stored {info.adapter_id} version {info.version} ({_size(info.size_bytes)})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    stub, token, rows = _stub(args), "", []
    while True:
        page = stub.ListAdapters(
            pb.ListAdaptersRequest(prefix=args.prefix, page_token=token, page_size=1000),
            timeout=args.timeout,
            metadata=connect.metadata(args),
        )
        rows += list(page.adapters)
        token = page.next_page_token
        if not token:
            break
    if args.json:
        print(json.dumps([_info_dict(i) for i in rows], indent=2))
        return 0
    header = f"{'ADAPTER':40} {'VER':>4} {'RANK':>4} {'SIZE':>10}  {'CREATED (UTC)':19}  MODULES"
    print(header)
    for i in rows:
        modules = ",".join(m.removesuffix("_proj") for m in i.target_modules)
        print(
            f"{i.adapter_id:40} {i.version:>4} {i.rank:>4} {_size(i.size_bytes):>10}  "
            f"{_created(i):19}  {modules}"
        )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    info = _stub(args).GetAdapter(
        pb.GetAdapterRequest(adapter_id=args.id, version=args.version),
        timeout=args.timeout,
        metadata=connect.metadata(args),
    )
    details = _info_dict(info)
    if args.json:
        details["adapter_config"] = json.loads(info.adapter_config_json)
        print(json.dumps(details, indent=2))
    else:
        for key, value in details.items():
            print(f"{key:15} {value}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    response = _stub(args).DeleteAdapter(
        pb.DeleteAdapterRequest(adapter_id=args.id, version=args.version, all_versions=args.all),
        timeout=args.timeout,
        metadata=connect.metadata(args),
    )
    versions = ", ".join(str(v) for v in response.deleted_versions)
    print(f"deleted {args.id} version(s) {versions}")
    return 0


def _run(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn failures into one line on stderr that says what to do, and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (CliError, connect.ConnectFlagError) as exc:
            print(f"lorafleet: {exc}", file=sys.stderr)
        except grpc.RpcError as exc:
            report_rpc_error(exc, "adapter store", args.store, "--store", STORE_ENV)
        return 1

    return run


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("adapters", help="upload, list, inspect and delete adapters")
    parser.add_argument(
        "--store",
        default=os.environ.get(STORE_ENV, DEFAULT_STORE),
        help=f"adapter store address HOST:PORT (default ${STORE_ENV} or {DEFAULT_STORE})",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per call")
    connect.add_arguments(parser)
    # These may also follow the action: `adapters upload DIR --store H:P --token T`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=argparse.SUPPRESS, help="as above")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help="as above")
    connect.add_arguments(common, suppress=True)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    upload = actions.add_parser("upload", help="upload a PEFT adapter directory", parents=[common])
    upload.add_argument("dir", help="directory with adapter_config.json and the safetensors")
    upload.add_argument("--id", required=True, help="adapter id, for example acme/support-bot")
    upload.add_argument("--description", default="")
    upload.add_argument("--quiet", action="store_true", help="no progress bar")
    upload.set_defaults(handler=_run(cmd_upload))

    listing = actions.add_parser(
        "list", help="the latest version of every adapter", parents=[common]
    )
    listing.add_argument("--prefix", default="")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=_run(cmd_list))

    info = actions.add_parser("info", help="one adapter version's details", parents=[common])
    info.add_argument("id")
    info.add_argument("--version", type=int, default=0, help="default: the latest")
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=_run(cmd_info))

    delete = actions.add_parser(
        "delete", help="delete one version (default: latest) or all", parents=[common]
    )
    delete.add_argument("id")
    which = delete.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, default=0)
    which.add_argument("--all", action="store_true", help="every version of the adapter")
    delete.set_defaults(handler=_run(cmd_delete))
