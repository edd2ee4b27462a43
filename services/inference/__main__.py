"""Entry point: python -m services.inference --model DIR --adapter-store HOST:PORT [...]

Runs until SIGTERM or SIGINT, then stops cleanly (see server.py). `--help` lists every flag and
its environment variable.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.inference.config import ServiceConfig
from services.inference.server import InferenceServer

log = logging.getLogger("services.inference")


async def serve(config: ServiceConfig) -> None:
    server = InferenceServer(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    start = asyncio.create_task(server.start())
    stopper = asyncio.create_task(stop_requested.wait())
    failed = asyncio.create_task(server.failed.wait())
    try:
        done, _ = await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()  # a failed start-up raises here
            await asyncio.wait({stopper, failed}, return_when=asyncio.FIRST_COMPLETED)
        else:
            log.info("stop requested during start-up")
            start.cancel()
    finally:
        stopper.cancel()
        failed.cancel()
        await server.stop()
    if server.failed.is_set():
        raise RuntimeError("the engine process ended unexpectedly")


def main(argv: list[str] | None = None) -> int:
    config = ServiceConfig.from_args(argv)
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(serve(config))
    except Exception as exc:
        log.error("inference service failed: %s", exc, exc_info=config.log_level == "DEBUG")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
