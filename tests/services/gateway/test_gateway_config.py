"""GatewayConfig from flags over environment variables, validation with messages that name the
flag, and the one mapping of gRPC statuses to HTTP ones."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.errors import error_body, rpc_status


def test_flags_win_over_environment_and_shared_variables_fill_in():
    env = {
        "LORAFLEET_INFERENCE": "inf:50052",
        "LORAFLEET_ADAPTER_STORE": "store:50051",
        "LORAFLEET_GATEWAY_PORT": "9000",
        "LORAFLEET_GATEWAY_MAX_N": "4",
        "LORAFLEET_LOG_LEVEL": "debug",
    }
    cfg = GatewayConfig.from_args(["--port", "8100"], environ=env)
    assert cfg.inference == "inf:50052" and cfg.adapter_store == "store:50051"
    assert cfg.port == 8100 and cfg.max_n == 4 and cfg.log_level == "DEBUG"
    own = {**env, "LORAFLEET_GATEWAY_INFERENCE": "mine:1"}
    assert GatewayConfig.from_args([], environ=own).inference == "mine:1"
    defaults = GatewayConfig.from_args(["--inference", "i:1"], environ={})
    assert defaults.port == 8000 and defaults.host == "127.0.0.1"
    assert defaults.adapter_store is None and defaults.lora_path_root is None
    rooted = GatewayConfig.from_args(["--inference", "i:1", "--lora-path-root", "x"], environ={})
    assert rooted.lora_path_root == Path("x")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "--inference is required"),
        (["--inference", "nohostport"], "HOST:PORT"),
        (["--inference", "i:1", "--adapter-store", "s:"], "--adapter-store"),
        (["--inference", "i:1", "--port", "70000"], "--port"),
        (["--inference", "i:1", "--max-n", "0"], "--max-n"),
        (["--inference", "i:1", "--rpc-timeout-s", "0"], "--rpc-timeout-s"),
        (["--inference", "i:1", "--log-level", "chatty"], "--log-level"),
    ],
)
def test_bad_settings_exit_with_a_message_naming_them(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        GatewayConfig.from_args(argv, environ={})
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        GatewayConfig.from_args(["--inference", "i:1"], environ={"LORAFLEET_GATEWAY_MAX_N": "x"})
    assert "LORAFLEET_GATEWAY_MAX_N" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.FAILED_PRECONDITION, 400),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DATA_LOSS, 500),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_grpc_statuses_map_to_the_contracts_http_statuses(code, status):
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "what to fix")
    assert rpc_status(error) == (status, "what to fix")
    body = error_body(status, "what to fix")["error"]
    assert body["code"] == status and body["message"] == "what to fix" and body["type"]
