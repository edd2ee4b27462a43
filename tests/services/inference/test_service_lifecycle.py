"""The adapter path under change and failure, with real processes: a cold adapter loading while
other streams flow, hot reload of a new version, the store killed and restarted, SIGTERM, and
the store on SeaweedFS."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorafleet.v1 import inference_pb2 as pb
from tests.services.inference.reference import PROMPTS, assert_matches, mixed_requests
from tests.services.inference.stack import (
    Stream,
    collect,
    inference_proc,
    inference_stub,
    sampling,
    store_proc,
    upload,
    wait_for,
)

LONG = dict(max_new_tokens=1500, ignore_eos=True)


class Recorder(threading.Thread):
    """Consumes one stream in the background, timestamping each message."""

    def __init__(self, stub, request, timeout=120.0):
        super().__init__(daemon=True)
        self.call = stub.Generate(request, timeout=timeout)
        self.times: list[float] = []
        self.messages: list[pb.GenerateResponse] = []
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.start()

    def run(self):
        try:
            for msg in self.call:
                self.times.append(time.monotonic())
                self.messages.append(msg)
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details()

    def stream(self) -> Stream:
        return Stream(self.messages, self.code, self.details)

    def between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t < t1 for t in self.times)


def _listed(stack) -> dict[tuple[str, int], pb.ResidentAdapter]:
    reply = stack.stub.ListAdapters(pb.ListResidentAdaptersRequest(), timeout=10)
    return {(a.adapter_id, a.version): a for a in reply.adapters}


def test_cold_adapter_loads_while_other_streams_flow(stack_factory, reference):
    stack = stack_factory(flags=("--preload-adapters", "off"))  # "b" in the store only
    flowing = Recorder(stack.stub, pb.GenerateRequest(prompt="steady", sampling=sampling(**LONG)))
    wait_for(lambda: len(flowing.messages) >= 5, what="the base stream flowing")
    # A frozen store: the fetch is sent and waits for bytes that do not come yet.
    stack.store.send(signal.SIGSTOP)
    try:
        request = pb.GenerateRequest(prompt=PROMPTS[0], adapter_id="b")
        cold = Recorder(stack.stub, request)
        t0 = time.monotonic()
        loading = wait_for(lambda: _listed(stack).get(("b", 1)), timeout=5, what="b loading")
        assert loading.residency == pb.RESIDENCY_LOADING and loading.active_requests == 1
        time.sleep(1.0)
        t1 = time.monotonic()
        assert not cold.messages
        assert _listed(stack)[("b", 1)].residency == pb.RESIDENCY_LOADING
        stats = stack.stub.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.waiting_for_adapter == 1 and stats.running_requests == 1
        assert flowing.between(t0, t1) >= 20, "the base stream stalled during the fetch"
    finally:
        stack.store.send(signal.SIGCONT)
    cold.join(60)
    assert_matches(cold.stream(), reference.expect(request, version=1), request)
    assert flowing.is_alive() and flowing.code == grpc.StatusCode.OK
    flowing.call.cancel()


def test_several_requests_for_one_cold_adapter_start_one_fetch(stack_factory, reference):
    stack = stack_factory(flags=("--preload-adapters", "off"))  # "c" in the store only
    request = pb.GenerateRequest(prompt=PROMPTS[2], adapter_id="c")
    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(lambda _: collect(stack.stub, request), range(8)))
    for stream in streams:
        assert_matches(stream, reference.expect(request, version=1), request)
    stats = stack.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.adapter_fetch.count == 1
    assert stats.adapter_copy.count == 1


def test_hot_reload_serves_new_version_and_finishes_old_requests_on_theirs(
    stack_factory, svc_models, reference
):
    stack = stack_factory()
    # a, b and c preloaded into the pool (the default) first, so the pages counted below hold
    # them all.
    placed = {("a", 1), ("b", 1), ("c", 1)}
    wait_for(lambda: {k for k, v in _listed(stack).items() if v.residency == pb.RESIDENCY_GPU}
             == placed, what="a, b and c preloaded into the pool")  # fmt: skip
    params = sampling(max_new_tokens=500, ignore_eos=True)
    old_request = pb.GenerateRequest(prompt=PROMPTS[3], adapter_id="a", sampling=params)
    old = Recorder(stack.stub, old_request)
    wait_for(lambda: old.messages, what="the v1 stream started")
    pages_v1 = stack.stub.GetStats(pb.GetStatsRequest(), timeout=10).pool.adapter_pages
    assert upload(stack.store.address, "a", svc_models.adapters["a2"]).version == 2
    # The watch event arrives: version 1 is retired while its request is still in flight.
    v1 = wait_for(lambda: _listed(stack)[("a", 1)].retired and _listed(stack)[("a", 1)])
    assert v1.active_requests == 1 and old.is_alive()

    new_request = pb.GenerateRequest(prompt=PROMPTS[0], adapter_id="a")
    new = collect(stack.stub, new_request)
    assert new.last.adapter_version == 2
    assert_matches(new, reference.expect(new_request, version=2), new_request)
    assert _listed(stack)[("a", 2)].residency == pb.RESIDENCY_GPU

    old.join(120)
    assert old.code == grpc.StatusCode.OK, old.details
    assert {m.adapter_version for m in old.messages} == {1}
    expected = reference.expect(old_request, version=1)
    assert tuple(t for m in old.messages for t in m.token_ids) == expected.token_ids
    # The old version is dropped once its last request ended; its pages are free again.
    wait_for(lambda: ("a", 1) not in _listed(stack), what="version 1 dropped")
    stats = stack.stub.GetStats(pb.GetStatsRequest(), timeout=10)
    assert stats.pool.adapter_pages == pages_v1  # v2 has v1's shape: the same page count


def test_store_killed_and_restarted_mid_run(stack_factory, reference, tmp_path):
    # No preload: "b" stays in the store only, so its request needs the store.
    stack = stack_factory(flags=("--preload-adapters", "off"))
    resident = pb.GenerateRequest(prompt=PROMPTS[1], adapter_id="a")
    assert_matches(collect(stack.stub, resident), reference.expect(resident, 1), resident)
    flowing = Recorder(stack.stub, pb.GenerateRequest(prompt="steady", sampling=sampling(**LONG)))
    wait_for(lambda: flowing.messages, what="a base stream")

    stack.store.stop(signal.SIGKILL)
    base = pb.GenerateRequest(prompt=PROMPTS[4])
    assert_matches(collect(stack.stub, base), reference.expect(base), base)
    assert_matches(collect(stack.stub, resident), reference.expect(resident, 1), resident)
    cold = pb.GenerateRequest(prompt=PROMPTS[0], adapter_id="b")
    down = collect(stack.stub, cold, timeout=30)
    assert down.code == grpc.StatusCode.UNAVAILABLE, down.details
    assert "adapter store" in down.details
    health = health_pb2_grpc.HealthStub(stack.channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert flowing.is_alive() and flowing.code == grpc.StatusCode.OK

    restarted = store_proc(tmp_path / "store", tmp_path, port=stack.store.port).start()
    stack.store = restarted.wait_serving()

    def cold_works():
        stream = collect(stack.stub, cold, timeout=30)
        return stream if stream.code == grpc.StatusCode.OK else None

    assert_matches(wait_for(cold_works, timeout=20), reference.expect(cold, 1), cold)
    flowing.call.cancel()


def _stopped_while_flowing(streams: list[Recorder], stop) -> None:
    """Once every stream has a message, ``stop()``; each then ends UNAVAILABLE, saying the
    server is shutting down."""
    wait_for(lambda: all(s.messages for s in streams), what="the streams flowing")
    stop()
    for s in streams:
        s.join(30)
        assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
        assert "shutting down" in s.details


def test_sigterm_ends_streams_with_a_clear_status(svc_models, tmp_path):
    proc = inference_proc(svc_models.model, None, tmp_path, "--shutdown-grace-s", "0.5").start()
    try:
        seen_ready = False
        with grpc.insecure_channel(proc.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = inference_stub(channel)
            # Until health says SERVING, Inference calls are refused as UNAVAILABLE.
            while not seen_ready:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                except grpc.RpcError:
                    time.sleep(0.05)
                    continue
                seen_ready = status == health_pb2.HealthCheckResponse.SERVING
                if not seen_ready:
                    early = collect(stub, pb.GenerateRequest(prompt="x"))
                    if early.code == grpc.StatusCode.OK:
                        # The model finished loading between the two calls: health says so now.
                        now = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                        assert now == health_pb2.HealthCheckResponse.SERVING
                        continue
                    assert early.code == grpc.StatusCode.UNAVAILABLE and "loading" in early.details
            streams = [
                Recorder(stub, pb.GenerateRequest(prompt=p, sampling=sampling(**LONG)))
                for p in PROMPTS[:3]
            ]
            _stopped_while_flowing(streams, lambda: proc.send(signal.SIGTERM))
        assert proc.popen.wait(30) == 0
        assert "stopped" in proc.log()
    finally:
        proc.stop()


def test_sigterm_to_the_whole_process_group_stops_in_order(svc_models, tmp_path):
    """A supervisor that signals every process of the service (systemd's default, a Ctrl-C in
    a terminal) stops it as a SIGTERM to the service alone does: its children (the engine
    process, the fetch worker) ignore the signal and are stopped by the service in order, so
    no fetch fails for a worker killed under it and nothing is logged as a failure."""
    store = store_proc(tmp_path / "store", tmp_path).start().wait_serving()
    upload(store.address, "a", svc_models.adapters["a"])
    proc = inference_proc(
        svc_models.model, store.address, tmp_path, "--shutdown-grace-s", "0.5"
    )  # fmt: skip
    proc.new_session = True
    proc.start().wait_serving()
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = inference_stub(channel)
            first = collect(stub, pb.GenerateRequest(adapter_id="a", prompt="x"))
            assert first.code == grpc.StatusCode.OK  # fetched: the fetch worker runs
            streams = [
                Recorder(
                    stub, pb.GenerateRequest(prompt=p, adapter_id=a, sampling=sampling(**LONG))
                )
                for p, a in zip(PROMPTS[:2], ("a", ""), strict=True)
            ]
            _stopped_while_flowing(streams, lambda: proc.signal_group(signal.SIGTERM))
        assert proc.popen.wait(30) == 0
        log = proc.log()
        assert "the fetch worker was stopped" in log
        assert "the fetch worker exited" not in log
        assert " WARNING " not in log and " ERROR " not in log, log[-3000:]
    finally:
        proc.stop()
        store.stop()


def test_store_on_seaweedfs(seaweed, svc_models, reference, tmp_path, stack_factory):
    bucket = seaweed.create_bucket("inference-test")
    extra = ["--backend", "s3", "--s3-endpoint", seaweed.endpoint, "--s3-bucket", bucket]
    store = store_proc(tmp_path / "unused", tmp_path, extra=extra)
    store.env = {k: v for k, v in seaweed.env.items() if k.startswith("AWS_")}
    stack = stack_factory(store=store.start().wait_serving())
    requests = mixed_requests(40)[::2]  # their references are shared with the generate tests
    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: collect(stack.stub, r), requests))
    for request, stream in zip(requests, streams, strict=True):
        assert_matches(stream, reference.expect(request, version=1), request)


def test_service_exits_when_its_engine_process_dies(stack_factory):
    stack = stack_factory(uploads=())
    long = pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)
    )
    stream = Recorder(stack.stub, long)
    wait_for(lambda: stream.messages, what="a stream flowing")
    pid = int(re.search(r"engine process started \(pid (\d+)\)", stack.inference.log()).group(1))
    os.kill(pid, signal.SIGKILL)
    stream.join(30)
    assert stream.code == grpc.StatusCode.UNAVAILABLE and "engine process" in stream.details
    assert stack.inference.popen.wait(30) == 1
    assert "ended unexpectedly" in stack.inference.log()


def test_both_processes_freeze_what_start_up_left(stack_factory):
    """Full collections scan only what was allocated since start-up: the engine process paces
    its own (gc_pacing), and the service's stay automatic over a frozen start-up heap (before,
    some 180,000 objects of its imports alone: tens of ms a full collection, during which it
    read no report)."""
    stack = stack_factory(uploads=())
    found = {
        m.group(1): int(m.group(2))
        for m in re.finditer(
            r"(garbage collection paced by the step thread|the service's garbage collection "
            r"automatic); (\d+) start-up objects frozen",
            stack.inference.log(),
        )
    }
    assert set(found) == {
        "garbage collection paced by the step thread",
        "the service's garbage collection automatic",
    }, found
    assert min(found.values()) > 50_000, found
