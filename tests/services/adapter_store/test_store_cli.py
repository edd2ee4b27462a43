"""`lorafleet adapters ...` against a running adapter store."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from store.synthetic import synthetic_adapter
from tests.s3server import free_ports
from tests.services.adapter_store.store_harness import BASE, REPO


def cli(store_address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", "adapters", "--store", store_address, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_cli_round_trip(store, adapter_id, tmp_path):
    files = synthetic_adapter(BASE, rank=4, modules=("q_proj", "down_proj"))
    (tmp_path / "adapter_config.json").write_bytes(files.config_json)
    (tmp_path / "adapter_model.safetensors").write_bytes(files.safetensors)

    done = cli(store.address, "upload", str(tmp_path), "--id", adapter_id, "--description", "d")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"stored {adapter_id} version 1")
    assert "uploading" in done.stderr  # the progress bar
    assert (
        cli(store.address, "upload", str(tmp_path), "--id", adapter_id, "--quiet").returncode == 0
    )

    listing = cli(store.address, "list", "--prefix", adapter_id)
    assert listing.returncode == 0
    (row,) = [line for line in listing.stdout.splitlines() if line.startswith(adapter_id)]
    assert row.split()[1:3] == ["2", "4"] and row.endswith("q,down")
    as_json = json.loads(cli(store.address, "list", "--prefix", adapter_id, "--json").stdout)
    assert [(a["adapter_id"], a["version"]) for a in as_json] == [(adapter_id, 2)]

    info = json.loads(cli(store.address, "info", adapter_id, "--version", "1", "--json").stdout)
    assert info["version"] == 1 and info["description"] == "d"
    assert info["adapter_config"]["target_modules"] == ["q_proj", "down_proj"]
    assert info["size_bytes"] == len(files.safetensors)

    deleted = cli(store.address, "delete", adapter_id, "--all")
    assert deleted.returncode == 0 and "1, 2" in deleted.stdout
    missing = cli(store.address, "info", adapter_id)
    assert missing.returncode == 1
    assert "NOT_FOUND" in missing.stderr and adapter_id in missing.stderr


@pytest.mark.parametrize("store", ["local"], indirect=True)
def test_cli_errors_say_what_to_fix(store, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    done = cli(store.address, "upload", str(tmp_path), "--id", "x")
    assert done.returncode == 1
    assert "has no adapter_model.safetensors" in done.stderr

    (tmp_path / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    done = cli(store.address, "upload", str(tmp_path), "--id", "x", "--quiet")
    assert done.returncode == 1
    assert "INVALID_ARGUMENT" in done.stderr and "peft_type" in done.stderr

    (port,) = free_ports(1)
    done = cli(f"127.0.0.1:{port}", "--timeout", "5", "list")
    assert done.returncode == 1
    assert "is the adapter store running at" in done.stderr
