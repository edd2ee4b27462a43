"""Adapter-store processes shared by the service tests: one per backend."""

from __future__ import annotations

import uuid

import pytest

from tests.services.adapter_store.store_harness import StoreProcess


def new_bucket(seaweed) -> str:
    return seaweed.create_bucket(f"store-{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="module", params=["local", "s3"])
def store(request, tmp_path_factory):
    """A running adapter store on each backend; tests use their own adapter ids."""
    workdir = tmp_path_factory.mktemp(f"store-{request.param}")
    if request.param == "local":
        process = StoreProcess(workdir, "local")
    else:
        seaweed = request.getfixturevalue("seaweed")
        process = StoreProcess(workdir, "s3", seaweed, new_bucket(seaweed))
    process.start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture
def adapter_id() -> str:
    """A fresh adapter id per test."""
    return f"test/{uuid.uuid4().hex[:12]}"
