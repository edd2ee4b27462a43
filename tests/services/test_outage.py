"""services/outage.py: a run of failures logged as a first warning, one a period, then a line
when the operation works again."""

from __future__ import annotations

import logging

from services.outage import Outage


def test_a_run_of_failures_warns_first_then_once_a_period_and_says_when_it_ends(caplog):
    caplog.set_level(logging.DEBUG, logger="outage-test")
    now = [100.0]
    outage = Outage(logging.getLogger("outage-test"), "watching X", every=60, clock=lambda: now[0])
    outage.succeeded()  # no run: nothing to say
    for _ in range(31):  # 2 s apart for 60 s: the first and the one at 60 s warn
        outage.failed("UNAVAILABLE: refused", "retrying in 2 s")
        now[0] += 2.0
    outage.succeeded()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in lines if level == logging.WARNING]
    assert warnings == [
        "watching X failed (UNAVAILABLE: refused); retrying in 2 s",
        "watching X has failed for 60 s (31 attempts, the last: UNAVAILABLE: refused); still "
        "retrying in 2 s",
    ]
    assert sum(level == logging.DEBUG for level, _ in lines) == 29
    assert lines[-1] == (logging.INFO, "watching X works again, after 62 s and 31 failed attempts")
    # A new run starts afresh: its first failure warns at once.
    outage.failed("DEADLINE_EXCEEDED", "retrying in 0.1 s")
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage().startswith("watching X failed (DEADLINE_EXCEEDED)")
