"""The REST adapter registry and vLLM's runtime LoRA endpoints through an HTTP client, over the
real store and inference service: uploads streamed into the store, raw ids with slashes,
versions, deletes, errors, and an upload cut off mid-body that leaves no version."""

from __future__ import annotations

import socket
import time

import grpc
import httpx2 as httpx
import pytest

from lorafleet.v1 import adapter_store_pb2 as store_pb
from lorafleet.v1 import adapter_store_pb2_grpc as store_grpc
from lorafleet.v1 import inference_pb2 as pb
from services.gateway.errors import BadRequest
from services.gateway.lora_compat import _allowed
from tests.services.inference.stack import collect, sampling


def files(adapter_dir, config: bytes | None = None) -> dict:
    return {
        "adapter_config.json": config or (adapter_dir / "adapter_config.json").read_bytes(),
        "adapter_model.safetensors": (adapter_dir / "adapter_model.safetensors").read_bytes(),
    }


def post_adapter(stack, adapter_id: str, adapter_dir, **extra) -> httpx.Response:
    return httpx.post(
        stack.url("/v1/adapters"), data={"adapter_id": adapter_id, **extra},
        files=files(adapter_dir), timeout=30,
    )  # fmt: skip


def complete(stack, model: str, prompt: str = "The harbour") -> str:
    reply = httpx.post(
        stack.url("/v1/completions"),
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def grpc_text(stack, adapter_id: str, prompt: str = "The harbour") -> str:
    request = pb.GenerateRequest(
        adapter_id=adapter_id, prompt=prompt, sampling=sampling(max_new_tokens=8)
    )
    stream = collect(stack.stub, request)
    assert stream.code == grpc.StatusCode.OK, stream.details
    return stream.text


def store_get(stack, adapter_id: str):
    with grpc.insecure_channel(stack.store.address) as channel:
        stub = store_grpc.AdapterStoreStub(channel)
        return stub.GetAdapter(store_pb.GetAdapterRequest(adapter_id=adapter_id), timeout=10)


def test_upload_get_list_and_delete_versions_of_a_slashed_id(stack, gw_models):
    first = post_adapter(stack, "acme/support", gw_models.adapters["a"], description="first")
    assert first.status_code == 201, first.text
    body = first.json()
    assert body["id"] == "acme/support" and body["version"] == 1 and body["rank"] == 8
    assert body["description"] == "first" and body["adapter_config"]["r"] == 8
    second = post_adapter(stack, "acme/support", gw_models.adapters["a2"])
    assert second.status_code == 201 and second.json()["version"] == 2
    assert store_get(stack, "acme/support").sha256 == second.json()["sha256"]

    got = httpx.get(stack.url("/v1/adapters/acme/support"), timeout=10).json()
    assert got["version"] == 2
    old = httpx.get(stack.url("/v1/adapters/acme/support?version=1"), timeout=10).json()
    assert old["version"] == 1 and old["sha256"] == body["sha256"]
    listed = httpx.get(stack.url("/v1/adapters"), params={"prefix": "acme/"}, timeout=10).json()
    assert [(a["id"], a["version"]) for a in listed["data"]] == [("acme/support", 2)]
    everything = httpx.get(stack.url("/v1/adapters"), timeout=10).json()["data"]
    assert {"a", "b", "acme/support"} <= {a["id"] for a in everything}
    page = httpx.get(stack.url("/v1/adapters?page_size=1"), timeout=10).json()
    assert len(page["data"]) == 1 and page["next_page_token"]

    # The uploaded adapter serves by its id, as the gRPC API serves it.
    assert complete(stack, "acme/support") == grpc_text(stack, "acme/support")

    deleted = httpx.delete(stack.url("/v1/adapters/acme/support?version=2"), timeout=10)
    assert deleted.status_code == 200 and deleted.json()["versions"] == [2]
    assert httpx.get(stack.url("/v1/adapters/acme/support"), timeout=10).json()["version"] == 1
    assert httpx.delete(stack.url("/v1/adapters/acme/support"), timeout=10).json()["versions"] == [
        1
    ]
    gone = httpx.get(stack.url("/v1/adapters/acme/support"), timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == 404


@pytest.mark.parametrize(
    ("build", "status", "fragment"),
    [
        # The weights stream to the store as they arrive: the header's fields must come first.
        (lambda d: dict(files={"adapter_model.safetensors": b"x", **files(d)},
                        data={"adapter_id": "t/x"}), 400, "must come before"),
        (lambda d: dict(data={"adapter_id": "t/x", "colour": "red"}, files=files(d)), 400,
         "unknown form field 'colour'"),
        (lambda d: dict(data={"adapter_id": "t/x"}, files={**files(d), "sha256": b"0" * 64}), 400,
         "'sha256' must come before"),
        (lambda d: dict(data={"adapter_id": "t/x"},
                        files={"adapter_config.json": files(d)["adapter_config.json"]}), 400,
         "has no adapter_model.safetensors"),
        (lambda d: dict(data={"adapter_id": "t/x"}, files=files(d, b"{not json")), 400,
         "adapter_config.json"),
        (lambda d: dict(data={"adapter_id": "Bad Id!"}, files=files(d)), 400, "Bad Id!"),
        (lambda d: dict(json={"adapter_id": "t/x"}), 400, "multipart/form-data"),
    ],
)  # fmt: skip
def test_upload_errors_name_what_to_fix(stack, gw_models, build, status, fragment):
    # Several times: the store refuses a bad header while the weights are still being written,
    # and the store's own status must win over the failed write's (a race, about 1 in 2).
    for _ in range(6):
        reply = httpx.post(stack.url("/v1/adapters"), timeout=30, **build(gw_models.adapters["a"]))
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert fragment in error["message"] and error["code"] == status
    assert httpx.get(stack.url("/v1/adapters/t/x"), timeout=10).status_code == 404


def test_a_filename_that_is_not_utf8_does_not_matter(stack, gw_models):
    """The form's filenames are not read: bytes that are not UTF-8 in one change nothing."""
    adapter = gw_models.adapters["a"]
    boundary = "lorafleetboundary"

    def part(name: str, body: bytes, filename: bytes = b"") -> bytes:
        disposition = f'Content-Disposition: form-data; name="{name}"'.encode()
        if filename:
            disposition += b'; filename="' + filename + b'"'
        return f"--{boundary}\r\n".encode() + disposition + b"\r\n\r\n" + body + b"\r\n"

    body = (
        part("adapter_id", b"latin/name")
        + part("adapter_config.json", (adapter / "adapter_config.json").read_bytes(), b"\xe9t\xe9")
        + part("adapter_model.safetensors", (adapter / "adapter_model.safetensors").read_bytes(),
               b"\xff\xfe.safetensors")
        + f"--{boundary}--\r\n".encode()
    )  # fmt: skip
    reply = httpx.post(
        stack.url("/v1/adapters"), content=body, timeout=30,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )  # fmt: skip
    assert reply.status_code == 201, reply.text
    assert reply.json()["id"] == "latin/name" and reply.json()["version"] == 1


def test_a_client_that_leaves_mid_upload_leaves_no_version(stack, gw_models):
    adapter = gw_models.adapters["b"]
    boundary = "lorafleetboundary"
    head = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_id"\r\n\r\ncut/off\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="adapter_config.json"; '
            f'filename="adapter_config.json"\r\n\r\n'
        ).encode()
        + (adapter / "adapter_config.json").read_bytes()
        + (
            f"\r\n--{boundary}\r\nContent-Disposition: form-data; "
            f'name="adapter_model.safetensors"; filename="adapter_model.safetensors"\r\n\r\n'
        ).encode()
    )
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    request = (
        f"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nContent-Length: {len(head) + len(weights) + 64}"
        f"\r\nContent-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", stack.gateway.port)) as sock:
        sock.sendall(request + head + weights[: len(weights) // 2])
        time.sleep(0.5)  # the first half reaches the store
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as caught:
        store_get(stack, "cut/off")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # The gateway serves on: the same upload, whole, succeeds.
    assert post_adapter(stack, "cut/off", adapter).json()["version"] == 1


def test_vllm_load_and_unload_lora_adapter(stack, gw_models):
    loaded = httpx.post(
        stack.url("/v1/load_lora_adapter"),
        json={"lora_name": "vllm/a2", "lora_path": str(gw_models.adapters["a2"])},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["version"] == 1 and loaded.json()["residency"] == "gpu"
    assert store_get(stack, "vllm/a2").version == 1
    resident = stack.stub.ListAdapters(pb.ListResidentAdaptersRequest(), timeout=10)
    assert ("vllm/a2", pb.RESIDENCY_GPU) in {(a.adapter_id, a.residency) for a in resident.adapters}
    assert complete(stack, "vllm/a2") == grpc_text(stack, "vllm/a2")

    unloaded = httpx.post(
        stack.url("/v1/unload_lora_adapter"), json={"lora_name": "vllm/a2"}, timeout=30
    )
    assert unloaded.status_code == 200 and unloaded.json()["versions"] == [1]
    again = httpx.post(
        stack.url("/v1/unload_lora_adapter"), json={"lora_name": "never"}, timeout=30
    )
    assert again.status_code == 404
    # Without a path: an adapter the store already holds is loaded.
    assert (
        httpx.post(stack.url("/v1/load_lora_adapter"), json={"lora_name": "b"}, timeout=60).json()[
            "id"
        ]
        == "b"
    )
    missing = httpx.post(
        stack.url("/v1/load_lora_adapter"),
        json={"lora_name": "vllm/x", "lora_path": str(gw_models.model / "no-such-dir")},
        timeout=30,
    )
    assert missing.status_code == 400 and "not a directory" in missing.json()["error"]["message"]


def test_lora_path_must_lie_under_the_root_when_one_is_set(tmp_path):
    inside = tmp_path / "adapters" / "one"
    inside.mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "adapters" / "link").symlink_to(tmp_path / "other")
    assert _allowed(inside, tmp_path / "adapters") == inside.resolve()
    assert _allowed(tmp_path / "other", None) == (tmp_path / "other").resolve()
    for outside in (tmp_path / "other", tmp_path / "adapters" / "link", inside / ".." / ".."):
        with pytest.raises(BadRequest, match="outside"):
            _allowed(outside, tmp_path / "adapters")
    # The files read in it are resolved too: a symlink out of the root is refused.
    (inside / "adapter_config.json").write_text("{}")
    (tmp_path / "other" / "adapter_model.safetensors").write_bytes(b"secret")
    (inside / "adapter_model.safetensors").symlink_to(
        tmp_path / "other" / "adapter_model.safetensors"
    )
    with pytest.raises(BadRequest, match="adapter_model.safetensors in it is outside"):
        _allowed(inside, tmp_path / "adapters")
    assert _allowed(inside, None) == inside.resolve()  # no root: anywhere on this host
