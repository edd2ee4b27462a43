"""`lorafleet COMMAND ...`: dispatches to the subcommand modules of lorafleet.cli."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import lorafleet.cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lorafleet", description="lorafleet: multi-tenant LoRA serving."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_info in sorted(pkgutil.iter_modules(lorafleet.cli.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"lorafleet.cli.{module_info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args) or 0


if __name__ == "__main__":
    sys.exit(main())
