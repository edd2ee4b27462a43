"""Token files for --auth-tokens: generate tokens, keep only their sha256 in the token file.

    python -m services.tokens init DIR [--tenant NAME ...]
        Once: an admin token, the inference service's token and one token per tenant, each in
        DIR/<name>.token (mode 0600, DIR 0700), their digests in DIR/tokens.json, and the tokens
        printed once. Later runs change nothing and print only where the files are.
    python -m services.tokens add FILE --role tenant --tenant NAME  (or --role admin|service)
        A new token: its digest added to FILE (created if missing), the token printed once.

Files are replaced atomically (written beside, then renamed), so a running service that reloads
the token file never reads half of one.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from services.auth import Role, TokenFileError, parse_tokens, token_digest, valid_tenant

TOKENS_FILE = "tokens.json"
ADMIN, SERVICE = "admin", "service"


class Issued(NamedTuple):
    name: str  # admin, service, or the tenant's name
    token: str
    path: Path  # where the token is kept


def new_token() -> str:
    return "lft_" + secrets.token_urlsafe(32)


def _entry(role: Role, token: str, tenant: str | None = None) -> dict:
    entry = {"sha256": token_digest(token), "role": role.value}
    if tenant is not None:
        entry["tenant"] = tenant
    return entry


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path`` with mode 0600 (as mkstemp creates its files), atomically."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def init(directory: Path, tenants: list[str]) -> list[Issued]:
    """Generate the tokens of a deployment in ``directory`` unless it holds them already;
    returns what was issued now (empty when the directory was set up before)."""
    for name in tenants:
        if not valid_tenant(name) or name in (ADMIN, SERVICE, "tokens"):
            raise ValueError(f"{name!r} cannot name a tenant here")
    if (directory / TOKENS_FILE).is_file():
        return []
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    issued = [Issued(ADMIN, new_token(), directory / "admin.token")]
    issued.append(Issued(SERVICE, new_token(), directory / "service.token"))
    issued += [Issued(t, new_token(), directory / f"{t}.token") for t in tenants]
    entries = []
    for item in issued:
        if item.name == ADMIN:
            entries.append(_entry(Role.ADMIN, item.token))
        elif item.name == SERVICE:
            entries.append(_entry(Role.SERVICE, item.token))
        else:
            entries.append(_entry(Role.TENANT, item.token, item.name))
        write_private(item.path, item.token + "\n")
    # The token file last: its presence says the directory is complete.
    write_private(directory / TOKENS_FILE, json.dumps({"tokens": entries}, indent=2) + "\n")
    return issued


def add(path: Path, role: Role, tenant: str | None) -> str:
    """A new token of ``role`` whose digest is added to the token file at ``path``."""
    if role is Role.TENANT and (tenant is None or not valid_tenant(tenant)):
        raise ValueError("--role tenant needs --tenant NAME (lowercase letters, digits, . _ -)")
    if role is not Role.TENANT and tenant is not None:
        raise ValueError("only --role tenant takes --tenant")
    doc = {"tokens": []}
    if path.exists():
        text = path.read_text(encoding="utf-8")
        parse_tokens(text, str(path))  # refuse to extend a file the services would not read
        doc = json.loads(text)
    token = new_token()
    doc["tokens"].append(_entry(role, token, tenant))
    write_private(path, json.dumps(doc, indent=2) + "\n")
    return token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.tokens", description=__doc__)
    actions = parser.add_subparsers(dest="action", required=True)
    p_init = actions.add_parser("init", help="the tokens of a deployment, generated once")
    p_init.add_argument("dir", type=Path)
    p_init.add_argument("--tenant", action="append", default=[], help="repeatable")
    p_add = actions.add_parser("add", help="one more token in a token file")
    p_add.add_argument("file", type=Path)
    roles = [r.value for r in (Role.TENANT, Role.ADMIN, Role.SERVICE)]
    p_add.add_argument("--role", required=True, choices=roles)
    p_add.add_argument("--tenant")
    args = parser.parse_args(argv)
    try:
        if args.action == "init":
            issued = init(args.dir, args.tenant)
            if not issued:
                print(f"tokens already generated in {args.dir} (kept in its *.token files)")
                return 0
            print(f"generated tokens (shown once; kept in {args.dir}, mode 0600):")
            for item in issued:
                print(f"  {item.name:12} {item.token}   ({item.path.name})")
            return 0
        token = add(args.file, Role(args.role), args.tenant)
        print(token)
        print(f"(its sha256 is in {args.file}; the token is shown only now)", file=sys.stderr)
        return 0
    except (ValueError, TokenFileError, OSError) as exc:
        print(f"tokens: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
