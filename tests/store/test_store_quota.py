"""A tenant's limits at the store, in process over the local backend: its storage quota
(--tenant-max-bytes: uploads that would pass it fail before they store anything, whoever else
uploads, and the room comes back when versions are deleted), its uploads in flight at once
(--tenant-max-concurrent-uploads), and every upload's idle limit (--upload-idle-timeout-s)."""

from __future__ import annotations

import asyncio

import pytest

from store.adapter_store import AdapterStore
from store.backends.local import LocalObjectStore
from store.base_model import BaseModelShape
from store.config import StoreConfig
from store.errors import AdapterTooLarge, TenantStorageFull, TooManyUploads, UploadTimedOut
from store.synthetic import synthetic_adapter
from store.upload import UploadHeader

FILES = synthetic_adapter(BaseModelShape(2, 64, 96, 4, 2, 16, 128), rank=4)
SIZE = len(FILES.safetensors)


async def _upload(store: AdapterStore, adapter_id: str, tenant: str | None, gate=None):
    async def chunks():
        half = SIZE // 2
        yield FILES.safetensors[:half]
        if gate is not None:
            await gate.wait()  # a concurrent upload holds here, mid-file
        yield FILES.safetensors[half:]

    header = UploadHeader(adapter_id, FILES.config_json.decode())
    return await store.upload(header, chunks(), tenant)


def _store(tmp_path, quota: int) -> AdapterStore:
    return AdapterStore(
        LocalObjectStore(tmp_path), StoreConfig(root=tmp_path, tenant_max_bytes=quota)
    )


async def test_uploads_past_a_tenants_quota_fail_and_store_nothing(tmp_path):
    store = _store(tmp_path, SIZE * 5 // 2)
    try:
        await _upload(store, "acme/a", "acme")
        await _upload(store, "acme/a", "acme")  # a second version counts too
        assert await store.tenant_bytes("acme") == 2 * SIZE
        with pytest.raises(TenantStorageFull) as refused:
            await _upload(store, "acme/b", "acme")
        message = str(refused.value)
        assert f"is {SIZE} bytes; the limit is {SIZE // 2}" in message
        assert f"tenant 'acme' stores {2 * SIZE} of the {SIZE * 5 // 2} bytes" in message
        assert "--tenant-max-bytes" in message
        assert isinstance(refused.value, AdapterTooLarge)  # RESOURCE_EXHAUSTED, as too large
        assert await store.tenant_bytes("acme") == 2 * SIZE  # nothing of it stored
        assert [r.adapter_id for r in (await store.list("acme/")).records] == ["acme/a"]

        await _upload(store, "beta/a", "beta")  # another tenant has its own room
        await _upload(store, "acme/c", None)  # an admin's upload is not limited
        with pytest.raises(TenantStorageFull, match="no room for another adapter"):
            await _upload(store, "acme/d", "acme")  # over already: refused before any byte

        await store.delete("acme/a", all_versions=True)
        await _upload(store, "acme/e", "acme")  # room again
        assert await store.tenant_bytes("acme") == 2 * SIZE
    finally:
        await store.close()


async def test_concurrent_uploads_of_one_tenant_never_leave_it_past_its_quota(tmp_path):
    """Two uploads that each fit the room at their start but not together: the check before
    each commit counts the other's finished blob, so at most one commits, and the other's blob
    is deleted."""
    store = _store(tmp_path, SIZE * 3 // 2)
    gate = asyncio.Event()
    try:
        uploads = [asyncio.create_task(_upload(store, f"acme/{n}", "acme", gate)) for n in "xy"]
        await asyncio.sleep(0.2)  # both have begun, each seeing room for one
        gate.set()
        results = await asyncio.gather(*uploads, return_exceptions=True)
        committed = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, TenantStorageFull)]
        assert len(committed) + len(refused) == 2 and len(committed) <= 1, results
        assert "with the tenant's other uploads it passes its quota" in str(refused[0])
        assert await store.tenant_bytes("acme") == SIZE * len(committed) <= SIZE * 3 // 2
    finally:
        await store.close()


async def test_a_tenant_holds_at_most_its_share_of_the_upload_slots(tmp_path):
    """With 4 slots a tenant may hold 2 (half, by default); a third of its uploads is refused
    at once, while another tenant's and an admin's go through; a finished one frees its slot."""
    config = StoreConfig(root=tmp_path, max_concurrent_uploads=4)
    assert config.tenant_upload_slots == 2
    store = AdapterStore(LocalObjectStore(tmp_path), config)
    gate = asyncio.Event()
    try:
        held = [asyncio.create_task(_upload(store, f"acme/{n}", "acme", gate)) for n in "xy"]
        await asyncio.sleep(0.2)
        with pytest.raises(TooManyUploads) as refused:
            await _upload(store, "acme/z", "acme")
        assert str(refused.value) == (
            "tenant 'acme' has 2 uploads in flight, its limit (--tenant-max-concurrent-uploads "
            "2); retry when one has finished"
        )
        other = asyncio.create_task(_upload(store, "beta/x", "beta", gate))
        admin = asyncio.create_task(_upload(store, "acme/w", None, gate))
        await asyncio.sleep(0.2)
        gate.set()
        await asyncio.gather(*held, other, admin)
        assert (await _upload(store, "acme/z", "acme")).version == 1
    finally:
        await store.close()


async def test_an_upload_that_stalls_fails_and_frees_its_slot(tmp_path):
    store = AdapterStore(LocalObjectStore(tmp_path), StoreConfig(
        root=tmp_path, max_concurrent_uploads=1, upload_idle_timeout_s=0.3
    ))  # fmt: skip
    try:
        with pytest.raises(UploadTimedOut, match=r"no bytes of the upload came for 0.3 s"):
            await _upload(store, "acme/slow", "acme", asyncio.Event())  # its gate never opens
        assert await store.tenant_bytes("acme") == 0
        assert await store.backend.pending_uploads() == []  # its multipart upload aborted
        assert (await _upload(store, "acme/fast", "acme")).version == 1  # the slot is free
    finally:
        await store.close()


def test_config_takes_the_quota_flag():
    assert StoreConfig.from_args(["--tenant-max-bytes", "1000"]).tenant_max_bytes == 1000
    assert StoreConfig.from_args([]).tenant_max_bytes is None
    given = StoreConfig.from_args(
        ["--tenant-max-concurrent-uploads", "3", "--upload-idle-timeout-s", "5"]
    )
    assert given.tenant_upload_slots == 3 and given.upload_idle_timeout_s == 5
    with pytest.raises(ValueError, match="tenant_max_concurrent_uploads must be at least 1"):
        StoreConfig(tenant_max_concurrent_uploads=0)
    with pytest.raises(ValueError, match="tenant_max_bytes must be positive"):
        StoreConfig(tenant_max_bytes=0)
