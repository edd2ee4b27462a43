"""The gateway as an operator runs it: health, metrics, clients that leave, SIGTERM, a service
that is down, --served-model-name, a model without a chat template, overload, and the caller's
credentials reaching both gRPC services (seen by a recording gRPC proxy in front of each)."""

from __future__ import annotations

import json
import signal
import threading
from concurrent import futures

import grpc
import httpx2 as httpx
import pytest

from lorafleet.v1 import inference_pb2 as pb
from tests.services.gateway.stack import gateway_proc, url, wait_http
from tests.services.inference.stack import free_port, inference_proc, wait_for

LONG = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1500, "ignore_eos": True}


def generated(stack) -> int:
    return stack.stub.GetStats(pb.GetStatsRequest(), timeout=10).generated_tokens


def running(stack) -> int:
    return stack.stub.GetStats(pb.GetStatsRequest(), timeout=10).running_requests


def test_health_and_metrics(stack):
    health = httpx.get(stack.url("/health"), timeout=10).json()
    assert health == {"status": "ok", "model": "tiny-llama", "inference": "SERVING",
                      "adapter_store": "SERVING"}  # fmt: skip
    reply = httpx.post(stack.url("/v1/completions"), json={**LONG, "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200
    httpx.get(stack.url("/v1/adapters/no/such"), timeout=10)
    text = httpx.get(stack.url("/metrics"), timeout=10).text
    assert 'lorafleet_gateway_requests_total{route="/v1/completions",status="200"}' in text
    assert 'route="/v1/adapters/{adapter_id:path}",status="404"' in text
    assert 'lorafleet_gateway_time_to_first_token_seconds_count{endpoint="completions"}' in text
    assert "lorafleet_gateway_generations_in_flight 0.0" in text


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_generation(stack, stream):
    wait_for(lambda: running(stack) == 0, what="an idle engine")
    before = generated(stack)
    if stream:
        with httpx.stream("POST", stack.url("/v1/completions"), json={**LONG, "stream": True},
                          timeout=60) as reply:  # fmt: skip
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(stack.url("/v1/completions"), json=LONG, timeout=1.5)
    wait_for(lambda: running(stack) == 0, timeout=30, what="the generation's end")
    # Aborted, not run to its 1500 tokens.
    assert generated(stack) - before < 1500


def test_sigterm_lets_streams_finish_within_the_grace_and_cuts_the_rest(stack, tmp_path):
    patient = gateway_proc(stack.inference.address, None, tmp_path, "--shutdown-grace-s", "30")
    patient.start()
    hasty = gateway_proc(stack.inference.address, None, tmp_path, "--shutdown-grace-s", "0.5")
    hasty.start()
    wait_http(patient)
    wait_http(hasty)
    results: dict[str, list[str]] = {}

    def read(name, proc, body):
        with httpx.stream("POST", url(proc, "/v1/completions"), json={**body, "stream": True},
                          timeout=60) as reply:  # fmt: skip
            results[name] = []
            try:
                for line in reply.iter_lines():
                    if line:
                        results[name].append(line)
            except httpx.TransportError:
                results[name].append("cut")

    short = threading.Thread(
        target=read,
        args=(
            "short",
            patient,
            {**LONG, "max_tokens": 400, "stream_options": {"include_usage": True}},
        ),
    )
    long = threading.Thread(target=read, args=("long", hasty, LONG))
    short.start()
    long.start()
    wait_for(lambda: len(results.get("short", [])) >= 2 and len(results.get("long", [])) >= 2)
    patient.send(signal.SIGTERM)
    hasty.send(signal.SIGTERM)
    short.join(30)
    long.join(30)
    # A clean stop exits 0 (wait: a second SIGTERM would only interrupt it).
    assert patient.popen.wait(30) == 0 and hasty.popen.wait(30) == 0, patient.log() + hasty.log()
    assert "Waiting for connections to close" in patient.log()  # the stream was in flight
    assert results["short"][-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in results["short"][:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 400
    assert results["long"][-1] != "data: [DONE]"
    wait_for(lambda: running(stack) == 0, timeout=30, what="the cut stream's abort")
    with pytest.raises(httpx.TransportError):
        httpx.get(url(patient, "/health"), timeout=2)


def test_an_unreachable_inference_service_answers_503(tmp_path):
    gateway = gateway_proc(f"127.0.0.1:{free_port()}", None, tmp_path).start()
    try:
        wait_http(gateway, "/metrics")
        for method, path, body in [
            ("GET", "/health", None),
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": "m", "prompt": "x"}),
        ]:
            reply = httpx.request(method, url(gateway, path), json=body, timeout=30)
            assert reply.status_code == 503, (path, reply.text)
            error = reply.json()["error"]
            assert error["code"] == 503 and error["type"] == "service_unavailable_error"
        reply = httpx.post(url(gateway, "/v1/adapters"), files={"x": b"y"}, timeout=10)
        assert reply.status_code == 400 and "--adapter-store" in reply.json()["error"]["message"]
    finally:
        gateway.stop()


class Tap(grpc.GenericRpcHandler):
    """A transparent gRPC proxy that records each call's method and metadata."""

    def __init__(self, upstream: str) -> None:
        self.channel = grpc.insecure_channel(upstream)
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(16))
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def service(self, details):
        metadata = dict(details.invocation_metadata)
        self.calls.append((details.method, metadata))
        forward = [(k, v) for k, v in details.invocation_metadata if k == "authorization"]
        upstream = self.channel.stream_stream(details.method)

        def handle(requests, context):
            try:
                yield from upstream(requests, metadata=forward)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details())

        return grpc.stream_stream_rpc_method_handler(handle)

    def since(self, n: int) -> list[tuple[str, dict[str, str]]]:
        return [(m, md) for m, md in self.calls[n:] if m.startswith("/lorafleet.v1.")]

    def stop(self) -> None:
        self.server.stop(0)
        self.channel.close()


@pytest.fixture(scope="module")
def plain_stack(stack, gw_models, tmp_path_factory):
    """A second inference service: the model without a chat template, served as
    "custom-base", two requests in flight at most; a gateway reaching it and the store through
    recording proxies."""
    tmp = tmp_path_factory.mktemp("plain-stack")
    inference = inference_proc(
        gw_models.plain, stack.store.address, tmp, "--served-model-name", "custom-base",
        "--max-queue", "1", "--max-num-seqs", "1",
    ).start()  # fmt: skip
    taps = {"inference": Tap(inference.address), "store": Tap(stack.store.address)}
    gateway = gateway_proc(taps["inference"].address, taps["store"].address, tmp).start()
    try:
        inference.wait_serving()
        wait_http(gateway)
        yield gateway, taps
    finally:
        gateway.stop()
        inference.stop()
        for tap in taps.values():
            tap.stop()


def test_served_model_name_and_a_model_without_a_chat_template(plain_stack):
    gateway, _ = plain_stack
    models = httpx.get(url(gateway, "/v1/models"), timeout=10).json()["data"]
    assert models[0]["id"] == "custom-base" and models[0]["max_model_len"] == 2048
    reply = httpx.post(
        url(gateway, "/v1/completions"),
        json={"model": "custom-base", "prompt": "The harbour", "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    chat = httpx.post(
        url(gateway, "/v1/chat/completions"),
        json={"model": "custom-base", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert chat.status_code == 400
    assert "has no chat template" in chat.json()["error"]["message"]


def test_a_full_inference_service_answers_429(plain_stack):
    gateway, _ = plain_stack
    reply = httpx.post(
        url(gateway, "/v1/completions"),
        json={"model": "custom-base", "prompt": "x", "max_tokens": 50, "n": 3},
        timeout=60,
    )
    assert reply.status_code == 429, reply.text
    assert reply.json()["error"]["type"] == "rate_limit_error"


def test_the_callers_bearer_token_reaches_both_services(plain_stack, gw_models):
    gateway, taps = plain_stack
    marks = {name: len(tap.calls) for name, tap in taps.items()}
    auth = {"Authorization": "Bearer tenant-secret"}
    adapter = gw_models.adapters["a"]
    requests = [
        ("GET", "/v1/models", {}),
        ("POST", "/v1/completions", {"json": {"model": "custom-base", "prompt": "x",
                                              "max_tokens": 2}}),
        ("POST", "/v1/adapters", {"data": {"adapter_id": "tapped/a"}, "files": {
            "adapter_config.json": (adapter / "adapter_config.json").read_bytes(),
            "adapter_model.safetensors": (adapter / "adapter_model.safetensors").read_bytes()}}),
        ("GET", "/v1/adapters/tapped/a", {}),
        ("POST", "/v1/load_lora_adapter", {"json": {"lora_name": "tapped/a"}}),
        ("POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "tapped/a"}}),
        ("DELETE", "/v1/adapters/tapped/a", {}),
    ]  # fmt: skip
    for method, path, kwargs in requests:
        reply = httpx.request(method, url(gateway, path), headers=auth, timeout=60, **kwargs)
        assert reply.status_code < 300, (path, reply.text)
    seen = {name: tap.since(marks[name]) for name, tap in taps.items()}
    methods = {m.rsplit("/", 1)[1] for calls in seen.values() for m, _ in calls}
    assert {"ListAdapters", "Generate", "UploadAdapter", "GetAdapter", "LoadAdapter",
            "UnloadAdapter", "DeleteAdapter"} <= methods  # fmt: skip
    for calls in seen.values():
        for method, metadata in calls:
            assert metadata.get("authorization") == "Bearer tenant-secret", method
    # Without the header, no credentials go on.
    mark = len(taps["inference"].calls)
    body = {"model": "custom-base", "prompt": "x", "max_tokens": 2}
    httpx.post(url(gateway, "/v1/completions"), json=body, timeout=60)
    anonymous = taps["inference"].since(mark)
    assert anonymous and all("authorization" not in md for _, md in anonymous)
