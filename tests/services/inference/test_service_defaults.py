"""Defaults the service derives from the machine: the host cache from its memory (a quarter,
1 to 64 GiB, the cgroup's limit when lower), the LoRA index rows from the engine's pool."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.inference import config as service_config
from services.inference.config import (
    ServiceConfig,
    default_host_cache_bytes,
    host_memory_bytes,
)
from services.inference.server import engine_config

GiB = 2**30


def test_host_cache_default_is_a_quarter_of_memory_within_bounds():
    assert default_host_cache_bytes(128 * GiB) == 32 * GiB  # the H200 machine
    assert default_host_cache_bytes(2 * GiB) == 1 * GiB  # at least 1 GiB
    assert default_host_cache_bytes(1024 * GiB) == 64 * GiB  # at most 64 GiB
    odd = default_host_cache_bytes(10 * GiB + 12345)
    assert odd % 2**20 == 0 and 2.5 * GiB - 2**20 < odd <= 2.5 * GiB


def test_host_memory_is_physical_memory_or_the_cgroup_limit(tmp_path, monkeypatch):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, unlimited = tmp_path / "memory.max", tmp_path / "v1.limit"
    unlimited.write_text("max\n")
    monkeypatch.setattr(service_config, "_CGROUP_LIMITS", (str(unlimited), str(tmp_path / "no")))
    assert host_memory_bytes() == physical
    limit.write_text(f"{3 * GiB}\n")
    monkeypatch.setattr(service_config, "_CGROUP_LIMITS", (str(limit),))
    assert host_memory_bytes() == min(physical, 3 * GiB)


def test_service_defaults_are_derived_and_flags_win():
    derived = ServiceConfig(model=Path("m"))
    assert derived.host_cache_mb is None and derived.max_loras is None
    assert derived.host_cache_bytes == default_host_cache_bytes(host_memory_bytes())
    assert engine_config(derived).max_loras is None  # the engine derives it from its pool
    given = ServiceConfig.from_args(
        ["--model", "m", "--host-cache-mb", "48", "--max-loras", "7"], environ={}
    )
    assert given.host_cache_bytes == 48 << 20 and engine_config(given).max_loras == 7


@pytest.mark.parametrize("flag", ["--max-loras", "--host-cache-mb"])
def test_derived_flags_still_refuse_zero(flag, capsys):
    with pytest.raises(SystemExit):
        ServiceConfig.from_args(["--model", "m", flag, "0"], environ={})
    assert flag in capsys.readouterr().err
