"""Entry point: python -m services.gateway --host H --port P --inference HOST:PORT
--adapter-store HOST:PORT [...]

Serves until SIGTERM or SIGINT, then stops cleanly: it stops accepting connections, lets
requests in flight (streams included) finish within --shutdown-grace-s, cancels the rest (their
generations are aborted) and closes its gRPC channels. `--help` lists every flag.
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig


def main(argv: list[str] | None = None) -> int:
    config = GatewayConfig.from_args(argv)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            lifespan="on",
            http="httptools",  # the C parser (requirements.txt pins it); h11 is pure Python
            log_config=None,  # the logging configured above
            access_log=False,  # requests are counted in the metrics instead
            timeout_graceful_shutdown=config.shutdown_grace_s,
        )
    )
    # uvicorn stops on SIGTERM/SIGINT with its own handlers, then raises the signal again
    # under the handlers it found: these make that second delivery a no-op, so a clean stop
    # exits 0, as the other services do.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
