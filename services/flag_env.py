"""Flags over environment variables, for the services' frozen config dataclasses.

A flag given on the command line wins; otherwise the field's variable PREFIX + NAME (upper
case), then a variable the whole stack shares (``shared``: field -> variable name); otherwise
the dataclass default stands. A variable's text is converted by the field's type in ``types``
(str when absent); a bad value exits with argparse's usage message naming the variable.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import fields
from typing import Any


def flag_values(
    cls: type,
    args: argparse.Namespace,
    environ: Mapping[str, str],
    prefix: str,
    shared: Mapping[str, str],
    types: Mapping[str, type],
    parser: argparse.ArgumentParser,
) -> dict[str, Any]:
    """The dataclass fields set by a flag or a variable."""
    values = {}
    for f in fields(cls):
        flag_value = getattr(args, f.name)
        if flag_value is not None:
            values[f.name] = flag_value
            continue
        raw = environ.get(prefix + f.name.upper())
        if raw is None and f.name in shared:
            raw = environ.get(shared[f.name])
        if raw is not None:
            kind = types.get(f.name, str)
            try:
                values[f.name] = kind(raw)
            except ValueError:
                parser.error(f"{prefix}{f.name.upper()}={raw!r} is not a valid {kind.__name__}")
    return values
