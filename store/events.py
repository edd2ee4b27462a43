"""In-process fan-out of adapter events to watchers (WatchAdapters)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum

from store.errors import WatchOverflow
from store.manifest import AdapterRecord

DEFAULT_QUEUE_EVENTS = 1024


class EventKind(Enum):
    CREATED = "created"
    DELETED = "deleted"


@dataclass(frozen=True)
class AdapterEvent:
    kind: EventKind
    record: AdapterRecord
    time: float = field(default_factory=time.time)


class Subscription:
    """One watcher's queue. A watcher that falls ``max_events`` behind is dropped (its iterator
    raises WatchOverflow) rather than letting the queue grow without bound."""

    def __init__(self, bus: EventBus, prefix: str, max_events: int) -> None:
        self.prefix = prefix
        self._bus = bus
        self._queue: asyncio.Queue[AdapterEvent] = asyncio.Queue(max_events)
        self.overflowed = False

    def offer(self, event: AdapterEvent) -> None:
        if not event.record.adapter_id.startswith(self.prefix) or self.overflowed:
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True
            self._bus.unsubscribe(self)

    def close(self) -> None:
        self._bus.unsubscribe(self)

    async def __aiter__(self) -> AsyncIterator[AdapterEvent]:
        try:
            while True:
                if self.overflowed and self._queue.empty():
                    raise WatchOverflow("watcher fell too far behind the events; watch again")
                event = await self._queue.get() if not self.overflowed else self._queue.get_nowait()
                yield event
        finally:
            self.close()


class EventBus:
    def __init__(self, max_events: int = DEFAULT_QUEUE_EVENTS) -> None:
        self._subscribers: set[Subscription] = set()
        self._max_events = max_events

    def subscribe(self, prefix: str = "") -> Subscription:
        subscription = Subscription(self, prefix, self._max_events)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def publish(self, event: AdapterEvent) -> None:
        for subscription in list(self._subscribers):
            subscription.offer(event)

    @property
    def watchers(self) -> int:
        return len(self._subscribers)
