"""The inference service with --tensor-parallel-size 2 on the CPU, through its real processes:
mixed streams over adapters fetched from the store equal the engine alone (one rank); a worker
killed mid-stream ends the stream with UNAVAILABLE and the service exits for its supervisor."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc

from lorafleet.v1 import inference_pb2 as pb
from tests.services.inference.reference import assert_matches, mixed_requests
from tests.services.inference.stack import collect, wait_for
from tests.services.inference.test_service_lifecycle import Recorder

TP = ("--tensor-parallel-size", "2")


def _worker_pid(stack) -> int:
    found = re.search(r"tensor parallel: 2 ranks \(workers \[(\d+)\]\)", stack.inference.log())
    assert found, "no tensor-parallel worker in the service's log"
    return int(found.group(1))


def test_two_ranks_serve_mixed_streams(stack_factory, reference):
    stack = stack_factory(flags=TP)
    requests = mixed_requests(40)[::5]  # base model and adapters a, b, c; greedy and seeded
    with ThreadPoolExecutor(len(requests)) as pool:
        streams = list(pool.map(lambda r: collect(stack.stub, r), requests))
    for request, stream in zip(requests, streams, strict=True):
        assert_matches(stream, reference.expect(request, version=1), request)


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
