"""The engine's device memory report (GetStats' device_memory, lorafleet_device_memory_bytes,
`lorafleet stats`): zeros on the CPU; on CUDA the driver's free and total and the allocator's
peak, read at most once a period (the CUDA tests check the values on a GPU:
test_engine_cuda.py)."""

from __future__ import annotations

import torch

from lorafleet.cli.stats import memory_line
from lorafleet.v1 import inference_pb2 as pb
from services.inference.engine.api import DeviceMemory
from services.inference.engine.pool_sizing import DeviceMemoryReader


def test_the_cpu_reports_no_device_memory():
    assert DeviceMemoryReader(torch.device("cpu")).read() == DeviceMemory(0, 0, 0)


def test_the_driver_and_the_allocator_are_asked_at_most_once_a_period(monkeypatch):
    asked, clock = [], [100.0]
    free, peak = iter(range(10, 100, 10)), iter(range(7, 100))

    def mem_get_info(device):
        asked.append(device)
        return next(free) << 30, 141 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: next(peak) << 30)
    monkeypatch.setattr("services.inference.engine.pool_sizing.time.monotonic", lambda: clock[0])
    reader = DeviceMemoryReader(torch.device("cuda", 0), every=1.0)
    assert reader.read() == DeviceMemory(141 << 30, 10 << 30, 7 << 30)
    clock[0] += 0.5
    assert reader.read() == DeviceMemory(141 << 30, 10 << 30, 7 << 30)  # within the period
    assert len(asked) == 1
    clock[0] += 0.5
    assert reader.read() == DeviceMemory(141 << 30, 20 << 30, 8 << 30) and len(asked) == 2
    assert asked == [torch.device("cuda", 0)] * 2


def test_the_cli_prints_the_device_memory_on_a_gpu_only():
    assert memory_line(pb.DeviceMemory()) is None  # the CPU reports zeros
    gib = 2**30
    m = pb.DeviceMemory(
        total_bytes=int(139.8 * gib), free_bytes=int(5.8 * gib), peak_reserved_bytes=128 * gib
    )
    assert memory_line(m) == (
        "memory    5.8 of 139.8 GiB free on the device, the engine's allocator at most 128.0 GiB"
    )
