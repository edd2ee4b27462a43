"""The inference service's metric families before and after adapter loads."""

from prometheus_client import generate_latest

from services.inference.metrics import ServiceMetrics


def _text(metrics: ServiceMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_load_series_exist_at_zero_before_the_first_load():
    metrics = ServiceMetrics()
    body = _text(metrics)
    for target in ("host", "preload", "pool"):
        assert f'lorafleet_adapter_loads_total{{target="{target}"}} 0.0' in body
    for phase in ("fetch", "preload", "copy"):
        assert f'lorafleet_adapter_load_seconds_count{{phase="{phase}"}} 0.0' in body


def test_each_load_phase_counts_in_its_own_series():
    metrics = ServiceMetrics()
    metrics.observe_load("fetch", 0.02)
    metrics.observe_load("copy", 0.003)
    metrics.observe_load("copy", 0.004)
    body = _text(metrics)
    assert 'lorafleet_adapter_loads_total{target="host"} 1.0' in body
    assert 'lorafleet_adapter_loads_total{target="preload"} 0.0' in body
    assert 'lorafleet_adapter_loads_total{target="pool"} 2.0' in body
    assert 'lorafleet_adapter_load_seconds_count{phase="copy"} 2.0' in body
    assert 'lorafleet_adapter_load_seconds_bucket{le="0.005",phase="copy"} 2.0' in body
