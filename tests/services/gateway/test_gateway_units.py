"""Parts of the gateway tested in-process, without services: request metrics for failures the
app's handlers answer, the model info's start-up asking against a service without
GetModelInfo, the generation endpoints' answers ahead of FastAPI against FastAPI's own, token
id prompts checked as the prompt's union checks them, and stream chunks encoded as events."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.testclient import TestClient

from services.gateway import completions
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.errors import BadRequest, ClientGone, validation_message
from services.gateway.model_info import ModelInfoCache
from services.gateway.openai_format import ChatFormat, CompletionFormat, event
from services.gateway.schemas import CompletionRequest, Int32, parse


def test_request_metrics_count_server_errors_as_500_and_clients_gone_as_499():
    app = create_app(GatewayConfig(inference="127.0.0.1:1"))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.get("/gone")
    async def gone():
        raise ClientGone()

    # No lifespan (no `with`): these routes need no gRPC channels.
    client = TestClient(app, raise_server_exceptions=False)
    reply = client.get("/boom")
    assert reply.status_code == 500 and reply.json()["error"]["code"] == 500
    assert client.get("/gone").status_code == 499
    text = client.get("/metrics").text
    assert 'lorafleet_gateway_requests_total{route="/boom",status="500"} 1.0' in text
    assert 'lorafleet_gateway_requests_total{route="/gone",status="499"} 1.0' in text


class _NoModelInfo:
    """An inference stub whose server has no GetModelInfo."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetModelInfo(self, request, metadata, timeout):
        self.calls += 1
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "no method"
        )


def test_prefetch_stops_on_a_service_without_get_model_info():
    stub = _NoModelInfo()
    cache = ModelInfoCache(stub, timeout=1.0)
    asyncio.run(asyncio.wait_for(cache.prefetch(), timeout=3.0))  # no retry every second
    assert stub.calls == 1 and cache.known is None


# (method, path, body): refused before any Generate call, or by an inference service that is
# not there (503).
REFUSED = [
    ("POST", "/v1/completions", b"{not json"),
    ("POST", "/v1/completions", b"[1]"),
    ("POST", "/v1/completions", json.dumps({"model": "m"}).encode()),
    ("POST", "/v1/completions", json.dumps({"model": "m", "prompt": [1, True]}).encode()),
    ("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x", "n": 0}).encode()),
    ("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x", "logprobs": 21}).encode()),
    ("POST", "/v1/completions", b" " * 100),  # beyond --max-request-bytes
    ("POST", "/v1/completions", json.dumps({"model": "m", "prompt": "x"}).encode()),  # 503
    ("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": []}).encode()),
    ("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": [{}]}).encode()),
    ("GET", "/v1/completions", b""),
    ("PUT", "/v1/chat/completions", b""),
]


THROUGH_FASTAPI = {"x-through": "fastapi"}


@pytest.fixture(scope="module")
def client():
    """The gateway's app, over an inference service that is not there; a request with
    THROUGH_FASTAPI's header enters it through FastAPI alone, as the other routes do."""
    app = create_app(GatewayConfig(inference="127.0.0.1:1", max_request_bytes=64))

    async def either(scope, receive, send):
        if (b"x-through", b"fastapi") in scope.get("headers", ()):
            await FastAPI.__call__(app, scope, receive, send)
        else:
            await app(scope, receive, send)

    with TestClient(either, raise_server_exceptions=False) as c:  # one event loop: the app's
        yield c


@pytest.mark.parametrize(("method", "path", "body"), REFUSED)
def test_generation_endpoints_answer_as_fastapi_routes_do(client, method, path, body):
    answers = [
        client.request(method, path, content=body, headers=headers, follow_redirects=False)
        for headers in ({}, THROUGH_FASTAPI)
    ]
    assert answers[0].status_code == answers[1].status_code >= 400
    assert answers[0].json() == answers[1].json()
    assert answers[0].json()["error"]["code"] == answers[0].status_code
    assert answers[0].headers["content-type"] == answers[1].headers["content-type"]
    metrics = client.get("/metrics").text
    assert f'route="{path}",status="{answers[0].status_code}"' in metrics


def test_generation_endpoints_redirect_a_trailing_slash_and_answer_a_bug_with_500(
    client, monkeypatch
):
    moved = client.post("/v1/completions/", content=b"{}", follow_redirects=False)
    assert moved.status_code == 307 and moved.headers["location"].endswith("/v1/completions")

    def bug(model, raw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(completions, "parse", bug)
    reply = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert reply.status_code == 500
    assert reply.json()["error"]["message"] == "internal error: RuntimeError: a bug"
    assert 'route="/v1/completions",status="500"' in client.get("/metrics").text


class _PromptUnion(BaseModel):
    """CompletionRequest's prompt without its token ids checked first."""

    model_config = ConfigDict(strict=True)
    prompt: str | list[str] | list[Int32] | list[list[Int32]]


@pytest.mark.parametrize(
    "prompt",
    [[5, 9, 2**31 - 1], [0], "text", ["a", "b"], [[1, 2], [3]], [], [1, True], [True],
     [1, -1], [1, 2**31], [1, 2.0], [1, "a"], [[1], 2], ["a", 1], 5, None, [None]],
)  # fmt: skip
def test_token_id_prompts_are_checked_as_the_union_checks_them(prompt):
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    try:
        want = _PromptUnion.model_validate({"prompt": prompt}).prompt
    except ValidationError as exc:
        with pytest.raises(BadRequest) as caught:
            parse(CompletionRequest, raw)
        assert caught.value.message == validation_message(exc.errors())
        return
    got = CompletionRequest.model_validate_json(raw).prompt
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("format_class", [CompletionFormat, ChatFormat])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_are_the_events_of_their_envelopes(format_class, include_usage):
    fmt = format_class("0f" * 16, 'mod"\u00e9l/\n\u2603', 2, include_usage)
    for choices in (
        [],
        [fmt.delta(0, 'x "\\ \n \x01 \u65e5', None)],
        [fmt.delta(0, "a", None), fmt.delta(1, "", "length")],
    ):
        body = {"id": fmt.id, "object": fmt.chunk_object_name, "created": fmt.created,
                "model": fmt.model, "choices": choices}  # fmt: skip
        if include_usage:
            body["usage"] = None
        assert fmt.chunk(choices) == event(body)
        assert json.loads(fmt.chunk(choices).removeprefix("data: ")) == body
