"""The engine's device memory report (GetStats' device_memory, lorafleet_device_memory_bytes):
zeros on the CPU; on CUDA the driver's free and total at most once a period and the allocator's
peak at every read (the CUDA tests check the values on a GPU: test_engine_cuda.py)."""

from __future__ import annotations

import torch

from services.inference.engine.pool_sizing import DeviceMemory, DeviceMemoryReader


def test_the_cpu_reports_no_device_memory():
    assert DeviceMemoryReader(torch.device("cpu")).read() == DeviceMemory(0, 0, 0)


def test_the_driver_is_asked_at_most_once_a_period(monkeypatch):
    asked, clock = [], [100.0]
    free = iter(range(10, 100, 10))

    def mem_get_info(device):
        asked.append(device)
        return next(free) << 30, 141 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 7 << 30)
    monkeypatch.setattr("services.inference.engine.pool_sizing.time.monotonic", lambda: clock[0])
    reader = DeviceMemoryReader(torch.device("cuda", 0), every=1.0)
    assert reader.read() == DeviceMemory(141 << 30, 10 << 30, 7 << 30)
    clock[0] += 0.5
    assert reader.read().free == 10 << 30 and len(asked) == 1  # within the period: as read
    clock[0] += 0.5
    assert reader.read().free == 20 << 30 and len(asked) == 2
    assert asked == [torch.device("cuda", 0)] * 2
