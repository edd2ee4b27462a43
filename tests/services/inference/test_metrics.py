"""The inference service's metric families before and after adapter loads."""

from prometheus_client import generate_latest

from services.auth import ANONYMOUS, Caller, Role
from services.inference.metrics import ServiceMetrics, tenant_label


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


def test_calls_count_per_tenant_with_their_tokens():
    """Each finished call counts under its caller, with its prompt and completion tokens; a
    caller without a tenant under its role, one refused before it was known as (unknown)."""
    metrics = ServiceMetrics()
    acme = Caller(Role.TENANT, "acme")
    metrics.observe_call(tenant_label(acme), "OK", 12, 30)
    metrics.observe_call(tenant_label(acme), "CANCELLED", 5, 2)
    metrics.observe_call(tenant_label(Caller(Role.ADMIN)), "OK", 3, 4)
    metrics.observe_call(tenant_label(None), "UNAUTHENTICATED", 0, 0)
    body = _text(metrics)
    for line in (
        'lorafleet_tenant_requests_total{code="OK",tenant="acme"} 1.0',
        'lorafleet_tenant_requests_total{code="CANCELLED",tenant="acme"} 1.0',
        'lorafleet_tenant_tokens_total{kind="prompt",tenant="acme"} 17.0',
        'lorafleet_tenant_tokens_total{kind="completion",tenant="acme"} 32.0',
        'lorafleet_tenant_tokens_total{kind="completion",tenant="(admin)"} 4.0',
        'lorafleet_tenant_requests_total{code="UNAUTHENTICATED",tenant="(unknown)"} 1.0',
        'lorafleet_requests_total{code="OK"} 2.0',
    ):
        assert line in body, line
    assert 'kind="prompt",tenant="(unknown)"' not in body  # no tokens: no token series
    assert tenant_label(ANONYMOUS) == "(anonymous)"
