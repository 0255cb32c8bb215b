"""Telemetry HTTP endpoints on a real socket."""

import json
import threading
import time
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
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{telemetry.port}{path}",
                                    timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


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
    metrics.nats_connected.set(1)
    ready = get(telemetry, "/health")
    assert ready == get(telemetry, "/health/ready")
    assert ready[0] == 200 and json.loads(ready[1])["status"] == "ready"
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


@pytest.mark.parametrize(("postgres", "nats"), [(0, 1), (1, 0), (0, 0)])
def test_not_ready_while_postgres_or_nats_is_down(server, postgres, nats):
    """/health answered 200 whatever the bridge's connections: an orchestrator's readiness
    probe and a monitor now see what is down."""
    metrics, telemetry, _ = server
    metrics.connected.set(postgres)
    metrics.nats_connected.set(nats)
    for path in ("/health", "/health/ready"):
        code, body = get(telemetry, path)
        assert code == 503
        assert json.loads(body) == {"status": "not ready", "postgres_streaming": bool(postgres),
                                    "nats_connected": bool(nats)}
    assert get(telemetry, "/health/live")[0] == 200  # (down servers are no reason to restart)


def test_not_live_while_the_event_loop_is_stalled(monkeypatch):
    import asyncio

    from cdc_platform import telemetry as telemetry_module

    monkeypatch.setattr(telemetry_module, "LOOP_TIMEOUT", 1.0)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    telemetry = TelemetryServer(BridgeMetrics(), port=0, loop=loop)
    telemetry.start()
    try:
        assert get(telemetry, "/health/live") == (200, '{"status": "live"}')
        loop.call_soon_threadsafe(time.sleep, 3)  # blocks the loop, as a stuck bridge would
        assert get(telemetry, "/health/live") == (503, '{"status": "event loop stalled"}')
    finally:
        telemetry.stop()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


def test_idle_connections_neither_pile_up_threads_nor_starve_a_probe(monkeypatch):
    """400 idle connections held 400 threads: now at most MAX_CONNECTIONS are served at once
    (the others are refused at once), and an idle one is dropped after IDLE_TIMEOUT."""
    import socket

    from cdc_platform import telemetry as telemetry_module

    monkeypatch.setattr(telemetry_module, "IDLE_TIMEOUT", 60.0)  # none times out meanwhile
    telemetry = TelemetryServer(BridgeMetrics(), port=0)
    telemetry.start()
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", telemetry.port), timeout=10)
            for _ in range(400)]
    try:
        refused = 0
        for connection in idle[telemetry_module.MAX_CONNECTIONS:]:
            if connection.recv(200).startswith(b"HTTP/1.0 503"):
                refused += 1
        assert refused == 400 - telemetry_module.MAX_CONNECTIONS
        assert threading.active_count() <= before + telemetry_module.MAX_CONNECTIONS
    finally:
        for connection in idle:
            connection.close()
    assert get(telemetry, "/health/live")[0] == 200  # slots freed as the clients went away
    telemetry.stop()

    monkeypatch.setattr(telemetry_module, "IDLE_TIMEOUT", 1.0)
    telemetry = TelemetryServer(BridgeMetrics(), port=0)
    telemetry.start()
    idle = [socket.create_connection(("127.0.0.1", telemetry.port), timeout=10)
            for _ in range(telemetry_module.MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 10
        while get(telemetry, "/health/live")[0] != 200:  # 503 until the idle ones time out
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for connection in idle:
            connection.close()
        telemetry.stop()


def test_a_non_ascii_authorization_header_is_refused_not_a_traceback(server, capfd):
    import http.client

    _, telemetry, stopped = server
    connection = http.client.HTTPConnection("127.0.0.1", telemetry.port, timeout=10)
    connection.putrequest("POST", "/shutdown")
    connection.putheader("Authorization", "Bearer s3cr\u00e9t".encode("latin-1"))
    connection.endheaders()
    assert connection.getresponse().status == 401
    connection.close()
    assert not stopped.is_set()
    assert "Traceback" not in capfd.readouterr().err
