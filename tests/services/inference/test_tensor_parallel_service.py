"""The inference service with --tensor-parallel-size 2 on the CPU, through its real processes:
mixed streams over adapters fetched from the store equal the engine alone (one rank); a worker
killed mid-stream ends the stream with UNAVAILABLE and the service exits for its supervisor, as
one killed while no stream runs makes it exit."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from lorafleet.v1 import inference_pb2 as pb
from tests.services.inference.reference import assert_matches, mixed_requests
from tests.services.inference.stack import collect, wait_for
from tests.services.inference.test_service_lifecycle import Recorder

TP = ("--tensor-parallel-size", "2")


def _worker_pid(stack) -> int:
    found = re.search(r"tensor parallel: 2 ranks \(workers \[(\d+)\]\)", stack.inference.log())
    assert found, "no tensor-parallel worker in the service's log"
    return int(found.group(1))


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_two_ranks_serve_mixed_streams(stack_factory, reference, engine):
    """The worker reads every adapter's bytes from the host arena it maps, where the fetch put
    them: none is sent to it (its count is logged when the group ends)."""
    stack = stack_factory(flags=(*TP, "--engine", engine))
    requests = mixed_requests(40)[::5]  # base model and adapters a, b, c; greedy and seeded
    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: collect(stack.stub, r), requests))
    for request, stream in zip(requests, streams, strict=True):
        assert_matches(stream, reference.expect(request, version=1), request)
    stack.inference.popen.send_signal(signal.SIGTERM)
    assert stack.inference.popen.wait(30) == 0
    loads = re.search(r"(\d+) adapter loads read by the workers from the shared arena, (\d+) "
                      r"sent", stack.inference.log())  # fmt: skip
    assert loads, "the tensor-parallel group did not report its loads"
    assert int(loads.group(1)) >= 3 and int(loads.group(2)) == 0  # adapters a, b and c


def test_service_exits_when_a_worker_dies(stack_factory):
    stack = stack_factory(uploads=(), flags=TP)
    long = pb.GenerateRequest(
        prompt="x", sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)
    )
    stream = Recorder(stack.stub, long)
    wait_for(lambda: stream.messages, what="a stream flowing")
    os.kill(_worker_pid(stack), signal.SIGKILL)
    stream.join(30)
    assert stream.code == grpc.StatusCode.UNAVAILABLE, stream.details
    assert "tensor-parallel workers exited" in stream.details
    assert stack.inference.popen.wait(30) == 1
    assert "ended unexpectedly" in stack.inference.log()


def test_service_exits_when_a_worker_dies_while_idle(stack_factory):
    """No stream runs: the engine's step loop finds the dead worker by itself, and the service
    exits for its supervisor rather than wait for a request to fail."""
    stack = stack_factory(uploads=(), flags=TP)
    os.kill(_worker_pid(stack), signal.SIGKILL)
    assert stack.inference.popen.wait(30) == 1
    assert "tensor-parallel workers exited" in stack.inference.log()
