"""Tenancy at the inference service, as deployed: both services with --auth-tokens and behind
mutual TLS, the inference service's store client (lookups, the watch, and
the fetch worker process) sending the service token; per-tenant quotas; the CLI."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from lorafleet.cli.adapters import upload_requests
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc
from lorafleet.v1 import inference_pb2 as pb
from lorafleet.v1 import inference_pb2_grpc as pb_grpc
from services import tls
from services.healthcheck import check
from tests.services.inference.stack import REPO, collect, inference_proc, store_proc, wait_for
from tests.services.tokens import Tokens, code_of, entries, make_tokens, write_token_file
from tests.tls_certs import Certs, make_certs

DENIED = grpc.StatusCode.PERMISSION_DENIED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Deployment:
    def __init__(self, tmp, svc_models) -> None:
        self.tmp = tmp
        self.certs: Certs = make_certs(tmp / "certs")
        self.tokens: Tokens = make_tokens(tmp / "tokens")
        c = self.certs
        self.store_credentials = tls.channel_credentials(c.ca, c.client.cert, c.client.key)
        self.inference_credentials = self.store_credentials  # the same CA and client cert
        self.store = store_proc(tmp / "store", tmp, extra=[
            "--backend", "local", "--root", str(tmp / "store"),
            "--auth-tokens", str(self.tokens.path),
            "--tls-cert", str(c.server.cert), "--tls-key", str(c.server.key),
            "--tls-client-ca", str(c.ca),
        ])  # fmt: skip
        self.store.credentials = self.store_credentials
        self.procs = [self.store]
        self.store.start().wait_serving()
        with grpc.secure_channel(self.store.address, self.store_credentials) as channel:
            stub = store_grpc.AdapterStoreStub(channel)
            for adapter_id, name in (("acme/a", "a"), ("beta/b", "b"), ("gamma/c", "c")):
                stub.UploadAdapter(
                    upload_requests(adapter_id, svc_models.adapters[name]),
                    metadata=self.tokens.md("admin"), timeout=30,
                )  # fmt: skip
        self.model = svc_models.model

    def inference(self, *flags: str, tls_on: bool = True):
        c, t = self.certs, self.tokens
        args = [
            "--auth-tokens", str(t.path), "--adapter-store-token-file", str(t.service_file),
            "--adapter-store-ca", str(c.ca), "--adapter-store-cert", str(c.client.cert),
            "--adapter-store-key", str(c.client.key), *flags,
        ]  # fmt: skip
        if tls_on:
            args += ["--tls-cert", str(c.server.cert), "--tls-key", str(c.server.key),
                     "--tls-client-ca", str(c.ca)]  # fmt: skip
        proc = inference_proc(self.model, self.store.address, self.tmp, *args)
        proc.credentials = self.inference_credentials if tls_on else None
        self.procs.append(proc)
        return proc.start().wait_serving()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def deployment(svc_models, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("tenancy"), svc_models)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def secure(deployment):
    """The inference service behind mutual TLS, tokens on, default limits."""
    proc = deployment.inference("--metrics-port", "0")
    channel = proc.channel()
    yield proc, pb_grpc.InferenceStub(channel)
    channel.close()


def tenant_series(proc) -> dict[tuple[str, str, str], float]:
    """The per-tenant series of the service's metrics: (requests, tenant, code) and (tokens,
    tenant, kind) -> value."""
    port = wait_for(lambda: re.search(r"metrics on http://[^:]+:(\d+)/", proc.log()), what="port")
    body = urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5).read()
    series = re.finditer(
        r'^lorafleet_tenant_(requests|tokens)_total\{(?:code|kind)="([^"]+)",tenant="([^"]+)"\} '
        r"(\S+)$", body.decode(), re.M,
    )  # fmt: skip
    return {(m.group(1), m.group(3), m.group(2)): float(m.group(4)) for m in series}


def gen(adapter_id="", max_new_tokens=4, **kwargs) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return pb.GenerateRequest(
        adapter_id=adapter_id, prompt="Hello there", sampling=sampling, **kwargs
    )


def streamed(stub, request, md, timeout=60.0):
    """collect() with call metadata."""
    out = collect(_WithMetadata(stub, md), request, timeout)
    return out


class _WithMetadata:
    def __init__(self, stub, md) -> None:
        self._stub, self._md = stub, md

    def Generate(self, request, timeout):  # noqa: N802 (the stub's method name)
        return self._stub.Generate(request, timeout=timeout, metadata=self._md)


def test_generate_needs_a_token_and_a_tenant_uses_only_its_own_adapters(deployment, secure):
    proc, stub = secure
    t = deployment.tokens
    for md in ((), (("authorization", "Bearer nope"),)):
        assert streamed(stub, gen(), md).code == UNAUTHENTICATED
        for method, request in (
            (stub.GetStats, pb.GetStatsRequest()),
            (stub.GetModelInfo, pb.GetModelInfoRequest()),
            (stub.ListAdapters, pb.ListResidentAdaptersRequest()),
            (stub.LoadAdapter, pb.LoadAdapterRequest(adapter_id="acme/a")),
            (stub.UnloadAdapter, pb.UnloadAdapterRequest(adapter_id="acme/a")),
        ):
            assert code_of(lambda m=method, r=request, md=md: m(r, metadata=md)) == UNAUTHENTICATED

    # Its own adapter: fetched cold through the fetch worker, with the service's token over
    # mutual TLS; the base model; never another tenant's adapter, existing or not.
    before = tenant_series(proc)
    mine = streamed(stub, gen("acme/a"), t.md("acme"))
    assert mine.code == grpc.StatusCode.OK, mine.details
    assert mine.last.usage.completion_tokens == 4
    assert streamed(stub, gen(""), t.md("acme")).code == grpc.StatusCode.OK
    for other in ("beta/b", "beta/missing", "acmex/a", "a"):
        refused = streamed(stub, gen(other), t.md("acme"))
        assert refused.code == DENIED and "'acme/'" in refused.details, (other, refused.details)
    # The same greedy tokens for the admin, who may use any adapter.
    assert streamed(stub, gen("acme/a"), t.md("admin")).token_ids == mine.token_ids
    assert streamed(stub, gen("beta/b"), t.md("admin")).code == grpc.StatusCode.OK
    assert streamed(stub, gen("beta/b"), t.md("beta")).code == grpc.StatusCode.OK

    # The service credential has no rights here, not even the base model.
    assert streamed(stub, gen(""), t.md("service")).code == DENIED
    # Each call counted under its caller, with its tokens (the prompt: "Hello there" encoded)
    counted = tenant_series(proc)
    delta = {k: v - before.get(k, 0.0) for k, v in counted.items() if v != before.get(k, 0.0)}
    prompt = 2 * mine.last.usage.prompt_tokens
    assert delta == {
        ("requests", "acme", "OK"): 2, ("requests", "acme", "PERMISSION_DENIED"): 4,
        ("tokens", "acme", "prompt"): prompt, ("tokens", "acme", "completion"): 8,
        ("requests", "(admin)", "OK"): 2, ("tokens", "(admin)", "prompt"): prompt,
        ("tokens", "(admin)", "completion"): 8, ("requests", "beta", "OK"): 1,
        ("tokens", "beta", "prompt"): prompt / 2, ("tokens", "beta", "completion"): 4,
        ("requests", "(service)", "PERMISSION_DENIED"): 1,
    }, delta  # fmt: skip
    assert code_of(lambda: stub.GetStats(pb.GetStatsRequest(), metadata=t.md("service"))) == DENIED
    assert stub.GetStats(pb.GetStatsRequest(), metadata=t.md("beta")).generated_tokens > 0
    info = pb.GetModelInfoRequest()
    assert code_of(lambda: stub.GetModelInfo(info, metadata=t.md("service"))) == DENIED
    for who in ("acme", "admin"):
        assert stub.GetModelInfo(info, metadata=t.md(who)).context_window > 0

    # Health needs no token (but mutual TLS: the server speaks nothing else).
    assert check(proc.address, timeout=5, credentials=deployment.inference_credentials)
    no_cert = tls.channel_credentials(deployment.certs.ca)
    for channel in (
        grpc.insecure_channel(proc.address),
        grpc.secure_channel(proc.address, no_cert),
    ):
        with channel:
            stub = pb_grpc.InferenceStub(channel)
            request = pb.GetStatsRequest()
            call = functools.partial(stub.GetStats, request, metadata=t.md("admin"), timeout=5)
            assert code_of(call) == grpc.StatusCode.UNAVAILABLE


def test_loads_unloads_and_listings_are_per_tenant_and_audited(deployment, secure):
    proc, stub = secure
    t = deployment.tokens
    loaded = stub.LoadAdapter(
        pb.LoadAdapterRequest(adapter_id="acme/a", pin=True), metadata=t.md("acme")
    )
    assert loaded.adapter.adapter_id == "acme/a" and loaded.adapter.pinned
    stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id="gamma/c"), metadata=t.md("admin"))
    load, unload = (
        pb.LoadAdapterRequest(adapter_id="gamma/c"),
        pb.UnloadAdapterRequest(adapter_id="gamma/c"),
    )
    for call in (
        lambda: stub.LoadAdapter(load, metadata=t.md("acme")),
        lambda: stub.UnloadAdapter(unload, metadata=t.md("acme")),
    ):
        assert code_of(call) == DENIED

    def listed(who):
        reply = stub.ListAdapters(pb.ListResidentAdaptersRequest(), metadata=t.md(who))
        return {a.adapter_id for a in reply.adapters}

    assert listed("acme") == {"acme/a"}
    assert listed("beta") <= {"beta/b"}
    assert {"acme/a", "gamma/c"} <= listed("admin")
    unloaded = stub.UnloadAdapter(
        pb.UnloadAdapterRequest(adapter_id="acme/a"), metadata=t.md("acme")
    )
    assert [a.adapter_id for a in unloaded.adapters] == ["acme/a"]

    log = wait_for(lambda: "action=unload role=tenant tenant=acme" in proc.log() and proc.log())
    assert "audit action=load role=tenant tenant=acme adapter=acme/a version=1 outcome=ok" in log
    assert "audit action=load role=admin tenant=- adapter=gamma/c version=1 outcome=ok" in log
    assert (
        "audit action=load role=tenant tenant=acme adapter=gamma/c version=latest outcome=denied"
        in log
    )
    assert (
        "audit action=unload role=tenant tenant=acme adapter=gamma/c version=latest outcome=denied"
        in log
    )
    assert (
        "audit action=unload role=tenant tenant=acme adapter=acme/a version=latest outcome=ok"
        in log
    )


def test_in_flight_and_queued_quotas_name_the_tenant_and_its_limit(deployment):
    proc = deployment.inference(
        "--max-num-seqs", "1", "--tenant-max-in-flight", "2", "--tenant-max-queued", "1",
        tls_on=False,
    )  # fmt: skip
    t = deployment.tokens
    with proc.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)

        def stats():
            return stub.GetStats(pb.GetStatsRequest(), metadata=t.md("admin"))

        # acme: one call running (the batch holds one), one queued behind it: a third is over
        # its in-flight limit.
        running = stub.Generate(gen("", max_new_tokens=1500), metadata=t.md("acme"), timeout=120)
        next(running)
        queued = stub.Generate(gen("", max_new_tokens=4), metadata=t.md("acme"), timeout=120)
        wait_for(lambda: stats().queued_requests == 1, what="the queued call")
        refused = streamed(stub, gen(""), t.md("acme"))
        assert refused.code == EXHAUSTED
        assert "tenant 'acme'" in refused.details
        assert "--tenant-max-in-flight 2" in refused.details
        # beta: one call waiting for its first token; a second is over its queued limit.
        waiting = stub.Generate(gen("", max_new_tokens=4), metadata=t.md("beta"), timeout=120)
        wait_for(lambda: stats().queued_requests == 2, what="beta's queued call")
        refused = streamed(stub, gen(""), t.md("beta"))
        assert refused.code == EXHAUSTED
        assert "tenant 'beta'" in refused.details and "--tenant-max-queued 1" in refused.details
        # Admins have no quota.
        admin = stub.Generate(gen(""), metadata=t.md("admin"), timeout=120)
        running.cancel()
        for call in (queued, waiting, admin):
            assert list(call)[-1].usage.completion_tokens == 4
        # Within the limits again: acme's calls go through.
        assert streamed(stub, gen(""), t.md("acme")).code == grpc.StatusCode.OK


def test_a_tenants_pins_stop_at_its_limit_while_others_pin_on(deployment, svc_models):
    """--tenant-max-pinned-mb: acme pins one adapter, and a second would pass its limit
    (RESOURCE_EXHAUSTED naming it), though it may still load it unpinned; pinning the same one
    again costs nothing; unloading makes room; other tenants and the admin are not held back."""
    t = deployment.tokens
    with grpc.secure_channel(deployment.store.address, deployment.store_credentials) as channel:
        stub = store_grpc.AdapterStoreStub(channel)
        for adapter_id in ("acme/a2", "beta/a"):  # acme/a's files again
            size = stub.UploadAdapter(
                upload_requests(adapter_id, svc_models.adapters["a"]), metadata=t.md("admin"),
                timeout=30,
            ).size_bytes  # fmt: skip
    proc = deployment.inference("--tenant-max-pinned-mb", str(1.5 * size / 2**20), tls_on=False)
    with proc.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)

        def load(adapter_id, who, pin=True):
            request = pb.LoadAdapterRequest(adapter_id=adapter_id, pin=pin)
            return stub.LoadAdapter(request, metadata=t.md(who), timeout=60)

        assert load("acme/a", "acme").adapter.pinned
        assert load("acme/a", "acme").adapter.pinned  # already pinned: not counted twice
        with pytest.raises(grpc.RpcError) as refused:
            load("acme/a2", "acme")
        assert refused.value.code() == EXHAUSTED
        assert "tenant 'acme' has" in refused.value.details()
        assert "pinning acme/a2 version 1" in refused.value.details()
        assert "--tenant-max-pinned-mb" in refused.value.details()
        warm = load("acme/a2", "acme", pin=False).adapter  # loading it unpinned is fine
        assert not warm.pinned and warm.residency == pb.RESIDENCY_GPU
        assert load("beta/a", "beta").adapter.pinned  # beta's room is its own
        assert load("gamma/c", "admin").adapter.pinned  # admins have none
        stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="acme/a"), metadata=t.md("acme"))
        assert load("acme/a2", "acme").adapter.pinned

        # Hot reload: a new version of a pinned adapter is pinned in its place while it fits
        # the tenant's limit; a larger one is loaded but left unpinned, with a warning.
        def resident(adapter_id):
            reply = stub.ListAdapters(pb.ListResidentAdaptersRequest(), metadata=t.md("admin"))
            return {(a.version, a.pinned) for a in reply.adapters if a.adapter_id == adapter_id}

        def new_version(adapter_id, name):
            with grpc.secure_channel(
                deployment.store.address, deployment.store_credentials
            ) as channel:
                return store_grpc.AdapterStoreStub(channel).UploadAdapter(
                    upload_requests(adapter_id, svc_models.adapters[name]),
                    metadata=t.md("admin"), timeout=30,
                )  # fmt: skip

        same_size = new_version("acme/a2", "a")
        wait_for(lambda: resident("acme/a2") == {(same_size.version, True)}, timeout=30)
        larger = new_version("acme/a2", "b")  # rank 16 on all seven projections
        assert larger.size_bytes > 1.5 * size
        warned = "loaded but not pinned: tenant 'acme' has 0.00 MiB of adapters pinned"
        wait_for(lambda: warned in proc.log(), timeout=30)
        wait_for(lambda: resident("acme/a2") == {(larger.version, False)}, timeout=30)
        assert load("beta/a", "beta").adapter.pinned  # beta's pin is untouched


def test_the_token_rate_quota_names_the_tenant_and_settles_to_what_a_call_used(deployment):
    proc = deployment.inference("--tenant-tokens-per-second", "20", tls_on=False)
    t = deployment.tokens
    with proc.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)
        # A call that fails before it runs costs nothing: charged 5000 tokens, settled to 0.
        bad = streamed(stub, gen("", max_new_tokens=5000), t.md("beta"))
        assert bad.code == grpc.StatusCode.INVALID_ARGUMENT
        assert streamed(stub, gen(""), t.md("beta")).code == grpc.StatusCode.OK
        # A call using twice the tenant's second's worth leaves it in debt for a second or so.
        assert streamed(stub, gen("", max_new_tokens=40), t.md("gamma")).code == grpc.StatusCode.OK
        refused = streamed(stub, gen(""), t.md("gamma"))
        assert refused.code == EXHAUSTED
        assert "tenant 'gamma' is over its limit of 20 tokens per second" in refused.details
        assert "--tenant-tokens-per-second" in refused.details
        # Another tenant is not held back; gamma may go on once the debt is paid.
        assert streamed(stub, gen(""), t.md("acme")).code == grpc.StatusCode.OK
        start = time.monotonic()
        wait_for(lambda: streamed(stub, gen(""), t.md("gamma")).code == grpc.StatusCode.OK, 10.0)
        assert time.monotonic() - start > 0.5


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_the_cli_sends_its_token_and_speaks_tls(deployment, secure, svc_models):
    proc, _ = secure
    c, t = deployment.certs, deployment.tokens
    store = ["adapters", "--store", deployment.store.address, "--ca", str(c.ca),
             "--cert", str(c.client.cert), "--key", str(c.client.key)]  # fmt: skip
    adapter = str(svc_models.adapters["a"])

    up = cli(*store, "upload", adapter, "--id", "acme/cli", "--quiet", "--token", t.acme)
    assert up.returncode == 0, up.stderr
    assert "stored acme/cli version 1" in up.stdout
    as_env = {"LORAFLEET_TOKEN": t.acme}
    listing = cli(*store, "list", "--json", env=as_env)
    assert listing.returncode == 0, listing.stderr
    assert "acme/cli" in listing.stdout and "beta/b" not in listing.stdout
    denied = cli(*store, "delete", "beta/b", env=as_env)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    anonymous = cli(*store, "list", env={"LORAFLEET_TOKEN": ""})
    assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
    assert "--token" in anonymous.stderr and "LORAFLEET_TOKEN" in anonymous.stderr
    no_tls = cli(
        "adapters", "--store", deployment.store.address, "--timeout", "5", "list", env=as_env
    )
    assert no_tls.returncode == 1 and "UNAVAILABLE" in no_tls.stderr

    server = ["--server", proc.address, "--ca", str(c.ca), "--cert", str(c.client.cert),
              "--key", str(c.client.key)]  # fmt: skip
    done = cli("generate", *server, "--adapter", "acme/cli", "--max-new-tokens", "3",
               "--ignore-eos", "Hi", env=as_env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "3 tokens, finish length" in done.stderr
    other = cli("generate", *server, "--adapter", "beta/b", "Hi", env=as_env)
    assert other.returncode == 1 and "PERMISSION_DENIED" in other.stderr
    stats = cli("stats", *server, "--json", "--token", t.acme)
    assert stats.returncode == 0, stats.stderr
    assert "acme/cli" in stats.stdout and "beta/b" not in stats.stdout
    cleaned = cli(*store, "delete", "acme/cli", "--all", env={"LORAFLEET_TOKEN": t.admin})
    assert cleaned.returncode == 0, cleaned.stderr


def test_a_token_added_to_the_file_works_at_once_at_both_services(deployment, secure):
    proc, stub = secure
    t = deployment.tokens
    new = "delta-token-6"
    from services.auth import token_digest

    items = [*entries(t), {"sha256": token_digest(new), "role": "tenant", "tenant": "delta"}]
    write_token_file(t.path, items)
    md = (("authorization", f"Bearer {new}"),)
    assert streamed(stub, gen(""), md).code == grpc.StatusCode.OK
    assert streamed(stub, gen("acme/a"), md).code == DENIED
    with grpc.secure_channel(deployment.store.address, deployment.store_credentials) as channel:
        from lorafleet.v1 import adapter_store_pb2 as store_pb

        reply = store_grpc.AdapterStoreStub(channel).ListAdapters(
            store_pb.ListAdaptersRequest(), metadata=md
        )
        assert list(reply.adapters) == []  # delta holds none
