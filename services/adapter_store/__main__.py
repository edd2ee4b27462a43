"""python -m services.adapter_store --host H --port P --backend local --root DIR
or --backend s3 --s3-endpoint URL --s3-bucket NAME (credentials from AWS_* variables)."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.adapter_store.server import serve
from services.auth import Authenticator, TokenFileError
from store.config import StoreConfig
from store.errors import StorageError


def main(argv: list[str] | None = None) -> int:
    try:
        config = StoreConfig.from_args(argv)
        config.base_shape  # noqa: B018 (read and check --base-model-config before serving)
    except ValueError as exc:
        print(f"adapter store: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        auth = Authenticator.from_file(config.auth_tokens)
    except TokenFileError as exc:
        print(f"adapter store: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config, auth))
    except StorageError as exc:
        logging.getLogger("services.adapter_store").error("cannot start: %s", exc)
        return 1
    except RuntimeError as exc:  # grpc: the address is taken or invalid
        logging.getLogger("services.adapter_store").error(
            "cannot listen on %s:%d: %s", config.host, config.port, exc
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
