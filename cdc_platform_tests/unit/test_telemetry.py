"""Telemetry HTTP endpoints on a real socket."""

import json
import threading
import urllib.error
import urllib.request

import pytest

from cdc_platform.telemetry import BridgeMetrics, TelemetryServer


@pytest.fixture
def server():
    metrics = BridgeMetrics()
    stopped = threading.Event()
    telemetry = TelemetryServer(metrics, port=0, admin_token="s3cret",
                                on_shutdown=stopped.set)
    telemetry.start()
    yield metrics, telemetry, stopped
    telemetry.stop()


def get(telemetry, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{telemetry.port}{path}") as response:
        return response.status, response.read().decode()


def post(telemetry, path, token=None):
    request = urllib.request.Request(f"http://127.0.0.1:{telemetry.port}{path}", method="POST",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_metrics_status_health(server):
    metrics, telemetry, _ = server
    metrics.events_published.inc(42)
    metrics.events_by_table.labels("users", "insert").inc(40)
    metrics.connected.set(1)
    metrics.confirmed_lsn = 0x16B374D848
    status, body = get(telemetry, "/metrics")
    assert status == 200
    assert "bridge_cdc_events_published_total 42.0" in body
    assert 'bridge_cdc_events_total{op="insert",table="users"} 40.0' in body
    assert "bridge_uptime_seconds" in body and "bridge_wal_lag_bytes" in body
    _, body = get(telemetry, "/status")
    status_json = json.loads(body)
    assert status_json["cdc_events_published"] == 42
    assert status_json["confirmed_lsn"] == "16/B374D848"
    assert status_json["is_connected"] is True
    assert get(telemetry, "/health") == (200, '{"status": "ok"}')
    assert "cdc_events=42" in metrics.logfmt()


def test_shutdown_needs_the_token(server):
    _, telemetry, stopped = server
    assert post(telemetry, "/shutdown") == 401
    assert post(telemetry, "/shutdown", token="wrong") == 401
    assert not stopped.is_set()
    assert post(telemetry, "/shutdown", token="s3cret") == 202
    assert stopped.wait(2)


def test_shutdown_disabled_without_token():
    telemetry = TelemetryServer(BridgeMetrics(), port=0)
    telemetry.start()
    try:
        assert post(telemetry, "/shutdown", token="anything") == 403
    finally:
        telemetry.stop()


def test_a_taken_port_is_one_line_naming_it(server):
    from cdc_platform.errors import CdcError

    _, telemetry, _ = server
    with pytest.raises(CdcError, match=rf"cannot serve telemetry on 127\.0\.0\.1:{telemetry.port} "
                                       r"\(Address already in use\): set CDC_HTTP_PORT"):
        TelemetryServer(BridgeMetrics(), port=telemetry.port)
