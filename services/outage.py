"""Logging a recurring operation's failures as an operator wants to read them.

A loop that retries (the inference service's watch of the adapter store, the store's rescans
of its storage) fails at every attempt while what it needs is down; a warning each time fills
the log (at a 2 s backoff, 1800 lines an hour) and hides everything else. An Outage says the
first failure as a warning, then one warning every ``every`` seconds while the failures go on
(the attempts between at DEBUG), and, when the operation works again, one line saying for how
long and how many attempts it failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class Outage:
    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``what``: the operation, as the subject of the log lines ("watching the adapter
        store at HOST:PORT")."""
        self.log, self.what, self.every, self._clock = logger, what, every, clock
        self.since: float | None = None  # the first failure of the run; None: no run
        self.attempts = 0  # failed attempts in the run
        self._warned = 0.0

    def failed(self, detail: str, retry: str = "retrying") -> None:
        """An attempt failed; ``detail`` says how, ``retry`` what happens next."""
        now = self._clock()
        self.attempts += 1
        if self.since is None:
            self.since = self._warned = now
            self.log.warning("%s failed (%s); %s", self.what, detail, retry)
        elif now - self._warned >= self.every:
            self._warned = now
            self.log.warning(
                "%s has failed for %.0f s (%d attempts, the last: %s); still %s",
                self.what, now - self.since, self.attempts, detail, retry,
            )  # fmt: skip
        else:
            self.log.debug("%s failed again (%s)", self.what, detail)

    def succeeded(self) -> None:
        """An attempt worked: ends the run, with a line if there was one."""
        if self.since is not None:
            self.log.info(
                "%s works again, after %.0f s and %d failed attempts",
                self.what, self._clock() - self.since, self.attempts,
            )  # fmt: skip
        self.since, self.attempts = None, 0
