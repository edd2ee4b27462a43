"""Tenancy at the inference service: who calls (services/auth.py) and per-tenant quotas.

Quotas apply to callers of role tenant (admin and anonymous callers have none), each limit per
tenant, all checked before a Generate call does any work:

- ``--tenant-max-in-flight N``: Generate calls in progress;
- ``--tenant-max-queued N``: calls that have not streamed their first token yet (waiting for
  the batch, for their adapter, or for their prefill);
- ``--tenant-tokens-per-second R``: a token bucket of R tokens a second holding at most one
  second's worth. A call may start while the bucket holds any token; it is charged its
  max_new_tokens (and its prompt, when given as token ids) at once and settled at its end to
  the prompt and completion tokens it used, so a tenant averages at most R over time and the
  bucket may go below zero (a debt that later calls wait out).

and one checked when a LoadAdapter call pins an adapter:

- ``--tenant-max-pinned-mb M``: the bytes of the tenant's pinned adapters (by default an
  eighth of the host cache): pins hold host-cache room and pool pages that every tenant's
  requests share.

A refusal is RESOURCE_EXHAUSTED naming the tenant, its limit and the flag that sets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from services.auth import Authenticator, Caller, Role
from services.inference.errors import TenantQuotaExceeded


@dataclass(frozen=True)
class Quotas:
    max_in_flight: int | None = None
    max_queued: int | None = None
    tokens_per_second: float | None = None
    max_pinned_bytes: int | None = None  # adapter bytes one tenant keeps pinned


@dataclass
class _Usage:
    in_flight: int = 0
    queued: int = 0
    tokens: float = 0.0  # the bucket's level
    stamp: float = 0.0  # when ``tokens`` was last brought up to date


class Ticket:
    """One admitted Generate call: ``started`` at its first token, ``close`` at its end."""

    def __init__(self, tenancy: Tenancy | None, tenant: str | None, charged: float | None):
        """``charged``: tokens taken from the bucket at admission; None = not metered."""
        self._tenancy, self._tenant, self._charged = tenancy, tenant, charged
        self._queued = tenancy is not None
        self._closed = False

    def started(self) -> None:
        if self._queued:
            self._queued = False
            self._tenancy._usage[self._tenant].queued -= 1

    def close(self, tokens_used: int) -> None:
        """Idempotent. ``tokens_used``: prompt + completion tokens (0 if it never ran)."""
        if self._tenancy is None or self._closed:
            return
        self._closed = True
        self.started()
        usage = self._tenancy._usage[self._tenant]
        usage.in_flight -= 1
        if self._charged is not None:
            usage.tokens += self._charged - tokens_used


_UNLIMITED = Ticket(None, None, None)


class Tenancy:
    def __init__(
        self,
        auth: Authenticator | None = None,
        quotas: Quotas | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.auth = auth or Authenticator(None)
        self.quotas = quotas or Quotas()
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def caller(self, context: grpc.aio.ServicerContext) -> Caller:
        return self.auth.caller(context)

    def admit(self, caller: Caller, estimate_tokens: int) -> Ticket:
        """Admit one Generate call of ``caller`` or raise TenantQuotaExceeded."""
        if caller.role is not Role.TENANT:
            return _UNLIMITED
        q, name = self.quotas, caller.tenant
        usage = self._usage.get(name)
        if usage is None:
            rate = q.tokens_per_second or 0.0
            usage = self._usage[name] = _Usage(tokens=rate, stamp=self._clock())
        if q.max_in_flight is not None and usage.in_flight >= q.max_in_flight:
            raise TenantQuotaExceeded(
                f"tenant {name!r} has {usage.in_flight} requests in flight, its limit "
                f"(--tenant-max-in-flight {q.max_in_flight}); retry when one has ended"
            )
        if q.max_queued is not None and usage.queued >= q.max_queued:
            raise TenantQuotaExceeded(
                f"tenant {name!r} has {usage.queued} requests waiting for their first token, "
                f"its limit (--tenant-max-queued {q.max_queued}); retry later"
            )
        if q.tokens_per_second is not None:
            now = self._clock()
            rate = q.tokens_per_second
            usage.tokens = min(rate, usage.tokens + (now - usage.stamp) * rate)
            usage.stamp = now
            if usage.tokens <= 0:
                raise TenantQuotaExceeded(
                    f"tenant {name!r} is over its limit of {rate:g} tokens per second "
                    f"(--tenant-tokens-per-second); retry in {max(0.1, -usage.tokens / rate):.1f} s"
                )
            usage.tokens -= estimate_tokens
        usage.in_flight += 1
        usage.queued += 1
        return Ticket(self, name, estimate_tokens if q.tokens_per_second is not None else None)

    def check_pin(self, caller: Caller, adapter: str, size: int, pinned: int) -> None:
        """A LoadAdapter of ``caller`` that pins ``adapter`` (``size`` bytes, not pinned yet),
        its tenant's pinned adapters holding ``pinned`` bytes: TenantQuotaExceeded where that
        would pass the tenant's max_pinned_bytes."""
        limit = self.quotas.max_pinned_bytes
        if caller.role is not Role.TENANT or limit is None or pinned + size <= limit:
            return
        raise TenantQuotaExceeded(
            f"tenant {caller.tenant!r} has {pinned / 2**20:.2f} MiB of adapters pinned; "
            f"pinning {adapter} ({size / 2**20:.2f} MiB) would pass its limit of "
            f"{limit / 2**20:.2f} MiB (--tenant-max-pinned-mb); unload one, or load this one "
            "without pin"
        )
