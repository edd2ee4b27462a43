"""Tenancy at the adapter store, over real gRPC on both backends: bearer tokens, namespaces,
the service and admin roles, listings and watches confined to a tenant, the audit log, the
token file's reload, and TLS with real handshakes."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lorafleet.v1 import adapter_store_pb2 as pb
from lorafleet.v1 import adapter_store_pb2_grpc as pb_grpc
from services import tls
from services.auth import token_digest
from store.synthetic import synthetic_adapter
from tests.services.adapter_store.store_harness import BASE, REPO, StoreProcess, upload_requests
from tests.services.tokens import code_of, entries, make_tokens, write_token_file
from tests.tls_certs import make_certs

SMALL = synthetic_adapter(BASE, rank=4, modules=("q_proj", "v_proj"), seed=7)
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return make_tokens(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module", params=["local", "s3"])
def store(request, tmp_path_factory, tokens):
    """A store with --auth-tokens on each backend."""
    workdir = tmp_path_factory.mktemp(f"auth-store-{request.param}")
    extra = ("--auth-tokens", str(tokens.path))
    if request.param == "local":
        process = StoreProcess(workdir, "local", extra_args=extra)
    else:
        seaweed = request.getfixturevalue("seaweed")
        bucket = seaweed.create_bucket(f"auth-{uuid.uuid4().hex[:10]}")
        process = StoreProcess(workdir, "s3", seaweed, bucket, extra_args=extra)
    process.start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture
def ids():
    """Fresh adapter ids under each tenant's namespace."""
    tag = uuid.uuid4().hex[:8]
    return {"acme": f"acme/{tag}", "beta": f"beta/{tag}"}


def fetch_body(stub, adapter_id, md) -> bytes:
    return b"".join(
        r.chunk
        for r in stub.FetchAdapter(pb.FetchAdapterRequest(adapter_id=adapter_id), metadata=md)
    )


def listed(stub, md, prefix="", page_size=0) -> list[str]:
    out, token = [], ""
    while True:
        page = stub.ListAdapters(
            pb.ListAdaptersRequest(prefix=prefix, page_size=page_size, page_token=token),
            metadata=md,
        )
        out += [a.adapter_id for a in page.adapters]
        token = page.next_page_token
        if not token:
            return out


def test_every_call_needs_a_known_token_while_health_and_reflection_stay_open(store, tokens, ids):
    stub = store.stub
    bad = [(), (("authorization", "Bearer not-a-token"),), (("authorization", "Basic abc"),)]
    bad.append((("authorization", f"Bearer {token_digest(tokens.acme)}"),))  # the digest: no
    for md in bad:
        calls = {
            "UploadAdapter": lambda: upload_requests(ids["acme"], SMALL),
            "FetchAdapter": lambda: pb.FetchAdapterRequest(adapter_id="acme/x"),
            "GetAdapter": lambda: pb.GetAdapterRequest(adapter_id="acme/x"),
            "ListAdapters": pb.ListAdaptersRequest,
            "DeleteAdapter": lambda: pb.DeleteAdapterRequest(adapter_id="acme/x"),
            "WatchAdapters": lambda: pb.WatchAdaptersRequest(include_existing=True),
        }
        for name, request in calls.items():
            method = getattr(stub, name)
            call = lambda m=method, r=request, md=md: m(r(), metadata=md, timeout=5)  # noqa: E731
            assert code_of(call) == grpc.StatusCode.UNAUTHENTICATED, (name, md)
    with pytest.raises(grpc.RpcError) as refused:
        stub.GetAdapter(pb.GetAdapterRequest(adapter_id="acme/x"))
    assert "authorization: Bearer TOKEN" in refused.value.details()
    assert store.blob_keys(ids["acme"]) == [] and store.pending_uploads() == []

    reply = store.health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(store.channel)
    answers = list(
        reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert "lorafleet.v1.AdapterStore" in names


def test_a_tenant_acts_only_under_its_own_name(store, tokens, ids):
    stub, acme, beta = store.stub, tokens.md("acme"), tokens.md("beta")
    mine = stub.UploadAdapter(upload_requests(ids["acme"], SMALL), metadata=acme)
    assert mine.version == 1
    assert fetch_body(stub, ids["acme"], acme) == SMALL.safetensors
    theirs = stub.UploadAdapter(upload_requests(ids["beta"], SMALL), metadata=beta)

    # Into another's namespace, or outside any: refused before a byte is stored.
    stored = store.object_keys()
    for target in (ids["beta"] + "-x", "shared/" + ids["acme"], "acme", "acmex/y"):
        with pytest.raises(grpc.RpcError) as refused:
            stub.UploadAdapter(upload_requests(target, SMALL), metadata=acme)
        assert refused.value.code() == DENIED
        assert "acme/" in refused.value.details() and target in refused.value.details()
    assert store.object_keys() == stored and store.pending_uploads() == []

    # Reading or deleting another's adapter, existing or not, says nothing of it.
    for target in (ids["beta"], "beta/does-not-exist"):
        get, delete = (
            pb.GetAdapterRequest(adapter_id=target),
            pb.DeleteAdapterRequest(adapter_id=target),
        )
        for call in (
            lambda r=get: stub.GetAdapter(r, metadata=acme),
            lambda t=target: fetch_body(stub, t, acme),
            lambda r=delete: stub.DeleteAdapter(r, metadata=acme),
        ):
            assert code_of(call) == DENIED
    assert stub.GetAdapter(pb.GetAdapterRequest(adapter_id=ids["beta"]), metadata=beta) == theirs
    assert (
        code_of(
            lambda: stub.GetAdapter(pb.GetAdapterRequest(adapter_id="acme/none"), metadata=acme)
        )
        == grpc.StatusCode.NOT_FOUND
    )

    # Listings: only the tenant's own, with or without a prefix, across pages.
    stub.UploadAdapter(upload_requests(ids["acme"] + "-2", SMALL), metadata=acme)
    for prefix in ("", "a", "acme/", ids["acme"]):
        names = listed(stub, acme, prefix, page_size=1)
        assert ids["acme"] in names and ids["acme"] + "-2" in names, prefix
        assert all(n.startswith("acme/") for n in names), (prefix, names)
    assert ids["beta"] not in listed(stub, acme)
    for prefix in ("beta/", "b", ids["beta"]):
        assert (
            code_of(
                lambda p=prefix: stub.ListAdapters(pb.ListAdaptersRequest(prefix=p), metadata=acme)
            )
            == DENIED
        )
    theirs_listed = listed(stub, beta)
    assert ids["beta"] in theirs_listed and all(n.startswith("beta/") for n in theirs_listed)

    deleted = stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id=ids["acme"]), metadata=acme)
    assert list(deleted.deleted_versions) == [1]


def test_a_tenants_watch_shows_only_its_own_adapters(store, tokens, ids):
    stub = store.stub
    stub.UploadAdapter(upload_requests(ids["beta"], SMALL), metadata=tokens.md("beta"))
    events: queue.Queue = queue.Queue()
    call = stub.WatchAdapters(
        pb.WatchAdaptersRequest(include_existing=True), metadata=tokens.md("acme")
    )

    def follow():
        try:
            for event in call:
                events.put(event.adapter.adapter_id)
        except grpc.RpcError:
            pass

    threading.Thread(target=follow, daemon=True).start()
    call.initial_metadata()
    stub.UploadAdapter(upload_requests(ids["beta"], SMALL), metadata=tokens.md("beta"))
    stub.UploadAdapter(upload_requests(ids["acme"], SMALL), metadata=tokens.md("acme"))
    seen = []
    while ids["acme"] not in seen:
        seen.append(events.get(timeout=10))
    time.sleep(0.2)
    while not events.empty():
        seen.append(events.get())
    call.cancel()
    assert all(name.startswith("acme/") for name in seen), seen

    # Watching another's prefix is refused.
    other = stub.WatchAdapters(pb.WatchAdaptersRequest(prefix="beta/"), metadata=tokens.md("acme"))
    assert code_of(lambda: other) == DENIED


def test_the_service_credential_reads_everything_and_writes_nothing(store, tokens, ids):
    stub, service = store.stub, tokens.md("service")
    stub.UploadAdapter(upload_requests(ids["beta"], SMALL), metadata=tokens.md("beta"))
    assert (
        stub.GetAdapter(pb.GetAdapterRequest(adapter_id=ids["beta"]), metadata=service).version == 1
    )
    assert fetch_body(stub, ids["beta"], service) == SMALL.safetensors
    assert ids["beta"] in listed(stub, service)
    watch = stub.WatchAdapters(pb.WatchAdaptersRequest(include_existing=True), metadata=service)
    assert any(e.adapter.adapter_id == ids["beta"] for e in _first(watch, ids["beta"]))
    delete = pb.DeleteAdapterRequest(adapter_id=ids["beta"])
    for call in (
        lambda: stub.UploadAdapter(upload_requests(ids["beta"], SMALL), metadata=service),
        lambda: stub.UploadAdapter(upload_requests("service/x", SMALL), metadata=service),
        lambda: stub.DeleteAdapter(delete, metadata=service),
    ):
        assert code_of(call) == DENIED
    assert (
        stub.GetAdapter(pb.GetAdapterRequest(adapter_id=ids["beta"]), metadata=service).version == 1
    )


def _first(watch, adapter_id):
    out = []
    for event in watch:
        out.append(event)
        if event.adapter.adapter_id == adapter_id:
            break
    watch.cancel()
    return out


def test_admin_may_do_anything_and_writes_are_audited(store, tokens, ids):
    stub, admin = store.stub, tokens.md("admin")
    shared = f"shared/{uuid.uuid4().hex[:8]}"
    assert stub.UploadAdapter(upload_requests(shared, SMALL), metadata=admin).version == 1
    stub.UploadAdapter(upload_requests(ids["beta"], SMALL), metadata=tokens.md("beta"))
    names = listed(stub, admin)
    assert shared in names and ids["beta"] in names
    deleted = stub.DeleteAdapter(
        pb.DeleteAdapterRequest(adapter_id=ids["beta"], all_versions=True), metadata=admin
    )
    assert list(deleted.deleted_versions) == [1]
    refused = pb.DeleteAdapterRequest(adapter_id=shared)
    assert code_of(lambda: stub.DeleteAdapter(refused, metadata=tokens.md("acme"))) == DENIED

    log = store.log()
    beta = ids["beta"]
    for line in (
        f"action=upload role=admin tenant=- adapter={shared} version=1 outcome=ok",
        f"action=upload role=tenant tenant=beta adapter={beta} version=1 outcome=ok",
        f"action=delete role=admin tenant=- adapter={beta} version=1 outcome=ok",
        f"action=delete role=tenant tenant=acme adapter={shared} version=latest outcome=denied",
    ):
        assert f"audit {line}" in log, line
    for secret in (tokens.acme, tokens.beta, tokens.admin, tokens.service):
        assert secret not in log  # tokens are never logged


def test_a_tenants_storage_quota_refuses_its_uploads_alone(seaweed, tokens, tmp_path):
    """--tenant-max-bytes over S3: a tenant's upload that would pass its stored bytes fails
    RESOURCE_EXHAUSTED naming its quota, and stores nothing; other tenants and the admin go
    on; deleting a version makes room."""
    size = len(SMALL.safetensors)
    bucket = seaweed.create_bucket(f"quota-{uuid.uuid4().hex[:10]}")
    extra = ("--auth-tokens", str(tokens.path), "--tenant-max-bytes", str(size * 3 // 2))
    store = StoreProcess(tmp_path, "s3", seaweed, bucket, extra_args=extra).start()
    try:
        stub, acme = store.stub, tokens.md("acme")
        assert stub.UploadAdapter(upload_requests("acme/one", SMALL), metadata=acme).version == 1
        with pytest.raises(grpc.RpcError) as refused:
            stub.UploadAdapter(upload_requests("acme/two", SMALL), metadata=acme)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"tenant 'acme' stores {size} of the {size * 3 // 2} bytes" in (
            refused.value.details()
        )
        assert listed(stub, acme) == ["acme/one"]
        assert store.object_keys("blobs/acme/") == store.blob_keys("acme/one")  # no leftover
        stub.UploadAdapter(upload_requests("beta/one", SMALL), metadata=tokens.md("beta"))
        stub.UploadAdapter(upload_requests("acme/three", SMALL), metadata=tokens.md("admin"))
        stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="acme/one"), metadata=acme)
        stub.DeleteAdapter(pb.DeleteAdapterRequest(adapter_id="acme/three"), metadata=acme)
        assert stub.UploadAdapter(upload_requests("acme/two", SMALL), metadata=acme).version == 1
        audit = "action=upload role=tenant tenant=acme adapter=acme/two version=latest"
        assert f"{audit} outcome=failed:TenantStorageFull" in store.log()
    finally:
        assert store.stop() == 0, store.log()


def test_the_token_file_is_read_again_when_it_changes(tmp_path):
    tokens = make_tokens(tmp_path / "tokens")
    store = StoreProcess(
        tmp_path / "store", "local", extra_args=("--auth-tokens", str(tokens.path))
    )
    store.start()
    try:
        stub = store.stub
        get = pb.ListAdaptersRequest()
        stub.ListAdapters(get, metadata=tokens.md("acme"))
        gamma = "gamma-token-5"
        # acme revoked, gamma added: without a restart.
        items = [e for e in entries(tokens) if e.get("tenant") != "acme"]
        items.append({"sha256": token_digest(gamma), "role": "tenant", "tenant": "gamma"})
        write_token_file(tokens.path, items)
        assert stub.ListAdapters(get, metadata=(("authorization", f"Bearer {gamma}"),)) is not None
        assert (
            code_of(lambda: stub.ListAdapters(get, metadata=tokens.md("acme")))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        # A file that no longer parses keeps the tokens in force, and says why in the log.
        tokens.path.write_text('{"tokens": [{"sha256": "nothex", "role": "admin"}]}')
        stub.ListAdapters(get, metadata=tokens.md("beta"))
        stub.ListAdapters(get, metadata=(("authorization", f"Bearer {gamma}"),))
        assert "tokens[0]: sha256 must be 64 lowercase hex digits" in store.log()
        assert "the previous tokens stay" in store.log()
    finally:
        assert store.stop() == 0, store.log()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[]", 'expected {"tokens": [...]}'),
        ('{"tokens": [{"sha256": "' + "a" * 64 + '", "role": "tenant"}]}', "a tenant needs a name"),
        ('{"tokens": [{"sha256": "' + "a" * 64 + '", "role": "root"}]}', "role must be"),
        ('{"tokens": [{"sha256": "' + "A" * 64 + '", "role": "admin"}]}', "lowercase hex"),
    ],
)
def test_a_bad_token_file_stops_the_start_saying_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "tokens.json"
    path.write_text(content)
    done = subprocess.run(
        [sys.executable, "-m", "services.adapter_store", "--port", "0", "--root",
         str(tmp_path / "root"), "--auth-tokens", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr and str(path) in done.stderr


def test_tls_and_mutual_tls_with_real_handshakes(tmp_path):
    certs = make_certs(tmp_path / "certs")
    tokens = make_tokens(tmp_path / "tokens")
    server = ("--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key))
    auth = ("--auth-tokens", str(tokens.path))
    plain_tls = StoreProcess(
        tmp_path / "tls", "local", extra_args=(*server, *auth),
        credentials=tls.channel_credentials(certs.ca),
    )  # fmt: skip
    mutual = StoreProcess(
        tmp_path / "mtls", "local",
        extra_args=(*server, "--tls-client-ca", str(certs.ca), *auth),
        credentials=tls.channel_credentials(certs.ca, certs.client.cert, certs.client.key),
    )  # fmt: skip
    try:
        plain_tls.start()
        mutual.start()
        for proc in (plain_tls, mutual):
            info = proc.stub.UploadAdapter(
                upload_requests("acme/tls", SMALL), metadata=tokens.md("acme")
            )
            assert fetch_body(proc.stub, "acme/tls", tokens.md("acme")) == SMALL.safetensors
            assert info.version == 1
            # TLS does not replace the token.
            assert (
                code_of(lambda p=proc: p.stub.ListAdapters(pb.ListAdaptersRequest()))
                == grpc.StatusCode.UNAUTHENTICATED
            )

        def attempt(address, credentials):
            channel = (
                grpc.insecure_channel(address)
                if credentials is None
                else grpc.secure_channel(address, credentials)
            )
            with channel:
                stub = pb_grpc.AdapterStoreStub(channel)
                return code_of(
                    lambda: stub.ListAdapters(
                        pb.ListAdaptersRequest(), metadata=tokens.md("acme"), timeout=5
                    )
                )

        ok = grpc.StatusCode.OK
        unavailable = grpc.StatusCode.UNAVAILABLE
        # Plain TCP to a TLS server, or trusting another CA: no handshake.
        assert attempt(plain_tls.address, None) == unavailable
        assert attempt(plain_tls.address, tls.channel_credentials(certs.other_ca)) == unavailable
        assert attempt(plain_tls.address, tls.channel_credentials(certs.ca)) == ok
        # Mutual TLS: a client certificate from the CA, none, or one from another CA.
        assert attempt(mutual.address, tls.channel_credentials(certs.ca)) == unavailable
        stranger = tls.channel_credentials(certs.ca, certs.stranger.cert, certs.stranger.key)
        assert attempt(mutual.address, stranger) == unavailable
        client = tls.channel_credentials(certs.ca, certs.client.cert, certs.client.key)
        assert attempt(mutual.address, client) == ok
    finally:
        for proc in (plain_tls, mutual):
            if proc.process is not None:
                assert proc.stop() == 0, proc.log()
