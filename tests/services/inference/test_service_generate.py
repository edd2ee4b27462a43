"""Generate over real gRPC: an adapter store and an inference service process, several uploaded
adapters, dozens of concurrent streams each identical to the engine running it alone, the
contract's status codes, cancellation storms that leave the pool balanced, and the admin RPCs."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lorafleet.v1 import inference_pb2 as pb
from tests.services.inference.conftest import start_stack, stop_stack
from tests.services.inference.reference import PROMPTS, assert_matches, mixed_requests
from tests.services.inference.stack import collect, sampling, upload, wait_for


@pytest.fixture(scope="module")
def stack(svc_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generate-stack")
    stack = start_stack(svc_models, tmp, flags=("--metrics-port", "0", "--max-loras", "2"))
    yield stack
    stop_stack(stack)


def test_concurrent_mixed_streams_match_the_engine_alone(stack, reference):
    requests = mixed_requests(40)
    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: collect(stack.stub, r), requests))
    for request, stream in zip(requests, streams, strict=True):
        assert_matches(stream, reference.expect(request, version=1), request)
        assert stream.last.adapter_version == (1 if request.adapter_id else 0)
    # Tokens stream out as they are produced, one message per step.
    long = [s for s in streams if len(s.token_ids) >= 4]
    assert long and all(len(s.messages) == len(s.token_ids) for s in long)


def test_logprobs_stream_with_their_tokens(stack):
    """Each message carries one logprob entry per token: the chosen token's (the best one for
    greedy, so also the first of its alternatives), with the alternatives in order."""
    request = pb.GenerateRequest(
        prompt_token_ids=[5, 9, 13, 17], sampling=sampling(max_new_tokens=6, logprobs=3)
    )
    stream = collect(stack.stub, request)
    assert stream.code == grpc.StatusCode.OK, stream.details
    entries = [lp for m in stream.messages for lp in m.logprobs]
    assert [lp.token_id for lp in entries] == stream.token_ids and len(entries) == 6
    for lp in entries:
        assert lp.logprob <= 0.0 and len(lp.top) == 3
        assert lp.top[0].token_id == lp.token_id and lp.top[0].logprob == lp.logprob
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
    again = pb.GenerateRequest(prompt_token_ids=[5, 9, 13, 17], sampling=sampling(max_new_tokens=6))
    plain = collect(stack.stub, again)
    assert plain.token_ids == stream.token_ids and not any(m.logprobs for m in plain.messages)


def test_request_id_is_generated_when_empty(stack):
    stream = collect(
        stack.stub, pb.GenerateRequest(prompt="hi", sampling=sampling(max_new_tokens=3))
    )
    assert stream.code == grpc.StatusCode.OK
    ids = {m.request_id for m in stream.messages}
    assert len(ids) == 1 and len(ids.pop()) >= 16


def test_calls_that_share_a_request_id_are_served_apart(stack, reference):
    """A request_id only labels a stream: calls in flight with the same one (two tenants', or
    two client processes', that picked it alike) are each served, matching the engine alone,
    each echoing it; one cancelled does not end the others."""
    requests = mixed_requests(12, seed=5)
    for r in requests:
        r.request_id = "same"
    cancelled = pb.GenerateRequest(
        request_id="same", prompt=PROMPTS[0], sampling=sampling(max_new_tokens=500, ignore_eos=True)
    )
    call = stack.stub.Generate(cancelled, timeout=120)
    next(call)  # in flight before the others start
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(collect, stack.stub, r) for r in requests]
        call.cancel()
        streams = [f.result() for f in futures]
    for request, stream in zip(requests, streams, strict=True):
        assert_matches(stream, reference.expect(request, version=1), request)
        assert {m.request_id for m in stream.messages} == {"same"}
    stats = pb.GetStatsRequest()
    wait_for(lambda: stack.stub.GetStats(stats).running_requests == 0, what="drained")


@pytest.mark.parametrize(
    ("fields", "code", "fragment"),
    [
        (dict(prompt="x", adapter_id="no-such-adapter"), grpc.StatusCode.NOT_FOUND,
         "no-such-adapter"),
        (dict(prompt="x", adapter_id="a", adapter_version=9), grpc.StatusCode.NOT_FOUND,
         "version 9"),
        (dict(prompt="x", adapter_id="Bad Id"), grpc.StatusCode.INVALID_ARGUMENT, "adapter_id"),
        (dict(prompt="x", adapter_id="a" * 129), grpc.StatusCode.INVALID_ARGUMENT, "at most 128"),
        (dict(prompt_token_ids=[5] * 2040, sampling=sampling(max_new_tokens=16)),
         grpc.StatusCode.INVALID_ARGUMENT, "context window"),
        (dict(prompt_token_ids=[5, 100000]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(prompt_token_ids=[5, -1]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (dict(prompt="x", sampling=sampling(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
         "top_p"),
        (dict(prompt="x", sampling=sampling(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "temperature"),
        (dict(prompt="x", sampling=sampling(max_new_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT,
         "max_new_tokens"),
        (dict(prompt="x", sampling=sampling(top_k=-2)), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (dict(prompt="x", adapter_version=3), grpc.StatusCode.INVALID_ARGUMENT,
         "adapter_version 3 is given without an adapter_id"),
        (dict(prompt="x", request_id="r" * 257), grpc.StatusCode.INVALID_ARGUMENT,
         "request_id is 257 characters; at most 256"),
        (dict(prompt="é" * 600_000), grpc.StatusCode.INVALID_ARGUMENT,
         "over 1048576 bytes of UTF-8 (--max-prompt-bytes)"),
        (dict(prompt_token_ids=[5] * 131073), grpc.StatusCode.INVALID_ARGUMENT,
         "131073 tokens; at most 131072"),
        (dict(prompt="x", sampling=sampling(stop=["s"] * 17)), grpc.StatusCode.INVALID_ARGUMENT,
         "17 stop strings; at most 16"),
        (dict(prompt="x", sampling=sampling(stop=["s" * 1025])), grpc.StatusCode.INVALID_ARGUMENT,
         "stop string of 1025 characters"),
        (dict(prompt="x", sampling=sampling(stop_token_ids=[1] * 129)),
         grpc.StatusCode.INVALID_ARGUMENT, "129 stop_token_ids; at most 128"),
        (dict(prompt="x", sampling=sampling(logprobs=21)), grpc.StatusCode.INVALID_ARGUMENT,
         "logprobs must be None or an integer in [0, 20]"),
    ],
)  # fmt: skip
def test_bad_requests_get_the_contract_status(stack, fields, code, fragment):
    stream = collect(stack.stub, pb.GenerateRequest(**fields))
    assert stream.code == code, stream.details
    assert fragment in stream.details
    assert not stream.messages


def test_adapter_for_another_base_model_is_failed_precondition(stack, svc_models):
    upload(stack.store.address, "mismatched", svc_models.mismatched)
    request = pb.GenerateRequest(prompt="hello", adapter_id="mismatched")
    for _ in range(2):  # the second answer comes from the remembered verdict, the same
        stream = collect(stack.stub, request)
        assert stream.code == grpc.StatusCode.FAILED_PRECONDITION, stream.details
        assert "base model" in stream.details and "q_proj" in stream.details


def _stats(stack) -> pb.GetStatsResponse:
    return stack.stub.GetStats(pb.GetStatsRequest(), timeout=10)


def _settled(stack):
    s = _stats(stack)
    if s.running_requests or s.queued_requests or s.waiting_for_adapter or s.pool.kv_pages:
        return None
    return s


def test_cancellation_storm_leaves_the_pool_balanced(stack):
    base = wait_for(lambda: _settled(stack), what="an idle server")
    rng = random.Random(5)
    calls = []
    for i in range(30):
        params = sampling(max_new_tokens=400, ignore_eos=True)
        request = pb.GenerateRequest(
            request_id=f"storm-{i}", prompt=PROMPTS[i % 5], adapter_id=["", "a", "b"][i % 3],
            sampling=params,
        )  # fmt: skip
        timeout = 0.5 + rng.random() if i % 4 == 0 else 60  # some die by their deadline
        calls.append((stack.stub.Generate(request, timeout=timeout), rng.randint(0, 6)))

    def consume(call, cancel_after):
        got = 0
        try:
            for _ in call:
                got += 1
                if got > cancel_after:
                    call.cancel()
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(len(calls)) as pool:
        codes = list(pool.map(lambda c: consume(*c), calls))
    assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert grpc.StatusCode.CANCELLED in codes
    after = wait_for(lambda: _settled(stack), what="the pool back at its baseline")
    assert after.pool.free_pages + after.pool.adapter_pages == after.pool.total_pages
    assert after.pool.free_pages + after.pool.adapter_pages == base.pool.free_pages + (
        base.pool.adapter_pages
    )
    # The server still serves.
    assert collect(stack.stub, pb.GenerateRequest(prompt="ok")).code == grpc.StatusCode.OK


def test_load_list_unload_and_stats(stack, reference):
    stub = stack.stub
    loaded = stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id="c", pin=True), timeout=30)
    assert loaded.adapter.residency == pb.RESIDENCY_GPU and loaded.adapter.pinned
    assert loaded.adapter.version == 1 and loaded.adapter.size_bytes > 0
    listed = {a.adapter_id: a for a in stub.ListAdapters(pb.ListResidentAdaptersRequest()).adapters}
    assert listed["c"].residency == pb.RESIDENCY_GPU and listed["c"].pinned
    # --max-loras 2: traffic for a and b cannot push the pinned adapter out of the pool.
    for name in ("a", "b", "a", "b"):
        assert collect(stub, pb.GenerateRequest(prompt="x", adapter_id=name)).code.name == "OK"
    listed = {a.adapter_id: a for a in stub.ListAdapters(pb.ListResidentAdaptersRequest()).adapters}
    assert listed["c"].residency == pb.RESIDENCY_GPU
    assert {listed["a"].residency, listed["b"].residency} <= {pb.RESIDENCY_GPU, pb.RESIDENCY_HOST}
    request = pb.GenerateRequest(prompt=PROMPTS[1], adapter_id="c")
    assert_matches(collect(stub, request), reference.expect(request, version=1), request)

    stats = _stats(stack)
    assert stats.pool.total_pages > 0 and stats.pool.adapter_pages > 0
    assert stats.generated_tokens > 0 and stats.resident_adapters >= 1
    # Each of a, b, c came from the store once: preloaded (the default) or for a request.
    assert stats.adapter_fetch.count + _preloads(stack) >= 3 and stats.adapter_copy.count >= 3
    assert stats.host_cache.entries >= 3 and stats.host_cache.used_bytes > 0
    assert stats.device == "cpu"

    unloaded = stub.UnloadAdapter(pb.UnloadAdapterRequest(adapter_id="c"), timeout=10)
    assert [a.adapter_id for a in unloaded.adapters] == ["c"]
    # Where it was when unloaded: in the pool (it had been pinned there), not "loading".
    assert unloaded.adapters[0].residency == pb.RESIDENCY_GPU and unloaded.adapters[0].retired
    listed = {a.adapter_id for a in stub.ListAdapters(pb.ListResidentAdaptersRequest()).adapters}
    assert "c" not in listed
    with pytest.raises(grpc.RpcError) as missing:
        stub.LoadAdapter(pb.LoadAdapterRequest(adapter_id="nope"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_reflection_and_metrics(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    for service in ("", "lorafleet.v1.Inference"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
    answers = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "lorafleet.v1.Inference" in names and "grpc.health.v1.Health" in names

    port = int(wait_for(lambda: _metrics_port(stack), what="the metrics port in the log"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "lorafleet_queue_depth", "lorafleet_running_requests",
        "lorafleet_time_to_first_token_seconds_bucket",
        "lorafleet_inter_token_latency_seconds_bucket", "lorafleet_tokens_per_second",
        'lorafleet_pool_pages{kind="kv"}', 'lorafleet_pool_pages{kind="adapter"}',
        'lorafleet_adapter_loads_total{target="host"}',
        'lorafleet_adapter_loads_total{target="preload"}',
        'lorafleet_adapter_load_seconds_bucket{le="0.001",phase="fetch"}',
        'lorafleet_adapter_evictions_total{tier="gpu"}',
        "lorafleet_adapter_evictions_queued_total 0.0",
        "lorafleet_host_cache_waiting_fetches 0.0",
        # a CPU service: no device memory to report
        'lorafleet_device_memory_bytes{kind="total"} 0.0',
        'lorafleet_device_memory_bytes{kind="peak_reserved"} 0.0',
        'lorafleet_engine_gc_collections_total{generation="2"}',
        'lorafleet_engine_gc_seconds_total{generation="0"}',
    ):  # fmt: skip
        assert name in body, name
    # The service follows the store from its start, so its fetch worker runs, once.
    assert "lorafleet_fetch_worker_starts_total 1.0" in body


def _preloads(stack) -> int:
    """Adapters the service preloaded from the store, from its metrics."""
    port = int(wait_for(lambda: _metrics_port(stack), what="the metrics port in the log"))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r'^lorafleet_adapter_loads_total\{target="preload"\} (\S+)$', body, re.M)
    return int(float(found.group(1))) if found else 0


def _metrics_port(stack) -> str | None:
    for line in stack.inference.log().splitlines():
        if "metrics on http://" in line:
            return line.rsplit(":", 1)[1].split("/")[0]
    return None


def test_full_queue_is_resource_exhausted(svc_models, tmp_path):
    stack = start_stack(
        svc_models, tmp_path, uploads=(), flags=("--max-queue", "1", "--max-num-seqs", "1")
    )
    try:
        long = sampling(max_new_tokens=1000, ignore_eos=True)
        first = stack.stub.Generate(pb.GenerateRequest(prompt="a", sampling=long), timeout=60)
        next(first)  # running
        second = stack.stub.Generate(pb.GenerateRequest(prompt="b", sampling=long), timeout=60)
        wait_for(lambda: _stats(stack).queued_requests == 1, what="a queued request")
        third = collect(stack.stub, pb.GenerateRequest(prompt="c"))
        assert third.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max-queue" in third.details
        first.cancel()
        assert next(second).token_ids  # the queued one runs once the first is gone
        second.cancel()
    finally:
        stop_stack(stack)


def test_cli_generate_streams_text_and_stats_reports(stack, reference):
    request = pb.GenerateRequest(
        prompt=PROMPTS[0], adapter_id="b", sampling=sampling(max_new_tokens=12)
    )
    expected = reference.expect(request, version=1)
    cli = [sys.executable, "-m", "lorafleet.cli"]
    out = subprocess.run(
        [*cli, "generate", "--server", stack.inference.address, "--adapter", "b",
         "--max-new-tokens", "12", PROMPTS[0]],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == expected.text + "\n"  # bytes: the text may hold a \r
    assert f"b v1: {len(expected.token_ids)} tokens" in out.stderr.decode()

    stats = subprocess.run(
        [*cli, "stats", "--server", stack.inference.address, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    data = json.loads(stats.stdout)
    assert data["stats"]["device"] == "cpu"
    assert data["stats"]["deviceMemory"] == {
        "totalBytes": "0", "freeBytes": "0", "peakReservedBytes": "0"
    }  # fmt: skip
    assert {a["adapterId"] for a in data["adapters"]} >= {"b"}

    missing = subprocess.run(
        [*cli, "generate", "--server", stack.inference.address, "--adapter", "nope", "x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
