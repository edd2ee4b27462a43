"""ServiceConfig: flags over environment variables, validation with messages that name the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.inference import config
from services.inference.config import ServiceConfig
from services.inference.engine.config import EngineConfig
from services.inference.engine.errors import AdapterLoadFailed
from services.inference.errors import QueueFull, StoreUnavailable, status_for
from services.inference.server import engine_config


def test_flags_win_over_environment_and_defaults_fill_the_rest():
    env = {
        "LORAFLEET_INFERENCE_MODEL": "/models/env",
        "LORAFLEET_INFERENCE_PORT": "6000",
        "LORAFLEET_INFERENCE_HOST_CACHE_MB": "32",
        "LORAFLEET_ADAPTER_STORE": "store:50051",
        "LORAFLEET_LOG_LEVEL": "debug",
    }
    cfg = ServiceConfig.from_args(["--port", "7000", "--device", "cpu"], environ=env)
    assert cfg.model == Path("/models/env") and cfg.port == 7000 and cfg.device == "cpu"
    assert cfg.host_cache_bytes == 32 << 20 and cfg.adapter_store == "store:50051"
    assert cfg.log_level == "DEBUG" and cfg.metrics_port is None and cfg.max_queue is None
    assert cfg.max_fetches == 8
    assert ServiceConfig.from_args(["--max-fetches", "2"], environ=env).max_fetches == 2
    own = {**env, "LORAFLEET_INFERENCE_ADAPTER_STORE": "mine:1"}
    assert ServiceConfig.from_args([], environ=own).adapter_store == "mine:1"


def test_engine_config_follows_the_service_config():
    cfg = ServiceConfig(model=Path("m"), max_queue=10, max_num_seqs=4, pool_memory_mb=3)
    ec = engine_config(cfg)
    assert ec.max_waiting == 10 and ec.max_num_seqs == 4 and ec.pool_memory_bytes == 3 << 20
    assert ec.max_queue is None  # the engine adds the running batch: 14 in flight at most
    own = engine_config(ServiceConfig.from_args(["--model", "m", "--fair-prefill-tokens", "64"]))
    assert own.fair_prefill_tokens == 64
    off = engine_config(ServiceConfig.from_args(["--model", "m", "--adapter-affinity", "0"]))
    assert off.adapter_affinity == 0
    assert engine_config(ServiceConfig(model=Path("m"))).adapter_affinity is None  # 2 x max seqs
    side = engine_config(ServiceConfig.from_args(["--model", "m", "--lora-side-stream", "off"]))
    assert not side.lora_side_stream
    share = ["--model", "m", "--gpu-memory-utilization", "0.9"]
    assert engine_config(ServiceConfig.from_args(share)).gpu_memory_utilization == 0.9
    defaults = engine_config(ServiceConfig(model=Path("m")))
    assert defaults.lora_side_stream and defaults.cuda_graphs and defaults.lora_addend
    addend = engine_config(ServiceConfig.from_args(["--model", "m", "--lora-addend", "off"]))
    assert not addend.lora_addend
    with pytest.raises(SystemExit):  # a word outside on/off is refused by the parser
        ServiceConfig.from_args(["--model", "m", "--lora-addend", "yes"])
    assert defaults.max_num_batched_tokens == 2048
    eager = ["--model", "m", "--cuda-graphs", "off", "--max-num-batched-tokens", "1024"]
    own = engine_config(ServiceConfig.from_args(eager))
    assert not own.cuda_graphs and own.max_num_batched_tokens == 1024
    assert (
        engine_config(ServiceConfig(model=Path("m"), max_num_seqs=4096)).max_num_batched_tokens
        == 4096
    )
    # the service's default share is the engine's own
    engine_default = EngineConfig(model_dir=Path("m")).gpu_memory_utilization
    assert defaults.gpu_memory_utilization == engine_default
    assert defaults.max_num_seqs is None and defaults.max_waiting is None  # derived by the engine


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "--model is required"),
        (["--model", "m", "--device", "tpu"], "--device"),
        (["--model", "m", "--adapter-store", "nohostport"], "HOST:PORT"),
        (["--model", "m", "--port", "70000"], "--port"),
        (["--model", "m", "--max-queue", "0"], "--max-queue"),
        (["--model", "m", "--host-cache-mb", "0"], "--host-cache-mb"),
        (["--model", "m", "--fetch-timeout-s", "0"], "--fetch-timeout-s"),
        (["--model", "m", "--log-level", "chatty"], "--log-level"),
        (["--model", "m", "--fair-prefill-tokens", "0"], "--fair-prefill-tokens"),
        (["--model", "m", "--adapter-affinity", "-1"], "--adapter-affinity"),
        (["--model", "m", "--max-fetches", "0"], "--max-fetches"),
        (["--model", "m", "--lora-side-stream", "yes"], "--lora-side-stream"),
        (["--model", "m", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--model", "m", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--model", "m", "--cuda-graphs", "maybe"], "--cuda-graphs"),
        (["--model", "m", "--tenant-max-pinned-mb", "0"], "--tenant-max-pinned-mb"),
        (["--model", "m", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (
            ["--model", "m", "--max-num-seqs", "64", "--max-num-batched-tokens", "32"],
            "--max-num-batched-tokens (32) must be at least --max-num-seqs (64)",
        ),
    ],
)
def test_bad_settings_exit_with_a_message_naming_them(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        ServiceConfig.from_args(argv, environ={})
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err


def test_a_tenants_pins_default_to_an_eighth_of_the_host_cache():
    config = ServiceConfig.from_args(["--model", "m", "--host-cache-mb", "1000"], environ={})
    assert config.tenant_pinned_bytes == 125 * 2**20
    given = ["--model", "m", "--tenant-max-pinned-mb", "0.5"]
    assert ServiceConfig.from_args(given, environ={}).tenant_pinned_bytes == 2**19


def test_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        ServiceConfig.from_args(["--model", "m"], environ={"LORAFLEET_INFERENCE_PORT": "x"})
    assert "LORAFLEET_INFERENCE_PORT" in capsys.readouterr().err


def test_status_mapping_covers_service_errors():
    assert status_for(QueueFull("full")).code.name == "RESOURCE_EXHAUSTED"
    assert status_for(StoreUnavailable("down")).code.name == "UNAVAILABLE"
    failed = status_for(AdapterLoadFailed("adapter a@1 could not be copied"))
    assert failed.code.name == "UNAVAILABLE" and failed.message.startswith("adapter a@1")
    assert status_for(RuntimeError("boom")).code.name == "INTERNAL"


def test_a_host_cache_beyond_the_hosts_memory_is_refused_naming_it(monkeypatch, capsys):
    """--host-cache-mb above HOST_CACHE_MAX_SHARE of the host's memory (its control group's
    limit where lower) would fill until the service is killed for memory: refused at start."""
    monkeypatch.setattr(config, "host_memory_bytes", lambda: 16 << 30)
    assert ServiceConfig(model=Path("m"), host_cache_mb=12288).host_cache_bytes == 12 << 30
    with pytest.raises(SystemExit):
        ServiceConfig.from_args(["--model", "m", "--host-cache-mb", "12289"], environ={})
    err = capsys.readouterr().err
    assert "--host-cache-mb 12289 is more than this host can give it: 16.0 GiB" in err
    assert "may take 75%, 12288 MiB" in err
