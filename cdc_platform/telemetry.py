"""Bridge telemetry: Prometheus metrics, ``/status`` JSON, health probes, a logfmt METRICS line.

``/health/live`` answers 200 while the bridge's event loop runs what it is given (503 when it
is stalled), ``/health/ready`` (and ``/health``) 200 only while both PostgreSQL and NATS are
connected (503 naming what is down). The HTTP server is the standard library's threaded one,
bound to 127.0.0.1 by default, with at most ``MAX_CONNECTIONS`` connections at once (one
thread each; the next is answered 503 at once) and ``IDLE_TIMEOUT`` seconds for a request to
arrive, so idle connections cannot pile up threads. The only admin action
(``POST /shutdown``) is off unless an admin token is configured, and then requires
``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cdc_platform.errors import CdcError
from cdc_platform.lsn import format_lsn

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16    # handler threads at once; scrapes and probes need a few
IDLE_TIMEOUT = 5.0      # seconds a connection may take to send its request
LOOP_TIMEOUT = 5.0      # seconds the event loop may take to run a no-op before "not live"


class BridgeMetrics:
    """Every figure the bridge reports; one registry per bridge (tests run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.started = time.monotonic()
        r = self.registry
        self.uptime = Gauge("bridge_uptime_seconds", "Seconds since start", registry=r)
        self.uptime.set_function(lambda: time.monotonic() - self.started)
        self.wal_messages = Counter("bridge_wal_messages_received",
                                    "pgoutput messages received", registry=r)
        self.events_published = Counter("bridge_cdc_events_published",
                                        "Change events published (each once, as read)", registry=r)
        self.events_by_table = Counter("bridge_cdc_events", "Change events published, by table/op",
                                       ["table", "op"], registry=r)
        self.transactions = Counter("bridge_transactions", "Transactions fully stored",
                                    registry=r)
        self.last_ack_lsn = Gauge("bridge_last_ack_lsn",
                                  "Last LSN confirmed (flushed) to PostgreSQL", registry=r)
        self.connected = Gauge("bridge_connected", "1 while streaming from PostgreSQL",
                               registry=r)
        self.nats_connected = Gauge("bridge_nats_connected", "1 while connected to NATS",
                                    registry=r)
        self.reconnects = Counter("bridge_reconnects", "PostgreSQL reconnections", registry=r)
        self.resyncs = Counter("bridge_slot_resyncs", "lost slots replaced by a new one "
                               "(CDC_ON_SLOT_LOST=resync), each marked in CDC", registry=r)
        self.nats_reconnects = Counter("bridge_nats_reconnects", "NATS reconnections",
                                       registry=r)
        self.last_processing_time_us = Gauge(
            "bridge_last_processing_time_us", "Decode+encode time of the last read batch, "
            "per message, in microseconds", registry=r)
        self.slot_active = Gauge("bridge_slot_active", "1 if the slot is active", registry=r)
        self.wal_lag_bytes = Gauge("bridge_wal_lag_bytes",
                                   "WAL not yet confirmed by the slot (bytes)", registry=r)
        self.retained_wal_bytes = Gauge("bridge_retained_wal_bytes",
                                        "WAL pinned by the slot (bytes)", registry=r)
        self.slot_wal_status = Gauge(
            "bridge_slot_wal_status", "pg_replication_slots.wal_status: 0 reserved, "
            "1 extended, 2 unreserved (invalidated at the next checkpoint), 3 lost", registry=r)
        self.slot_safe_wal_bytes = Gauge(
            "bridge_slot_safe_wal_bytes", "WAL that can still be written before the slot is "
            "invalidated (safe_wal_size; -1: unlimited)", registry=r)
        self.heartbeats = Counter("bridge_heartbeats", "Heartbeat messages emitted", registry=r)
        self.schema_changes = Counter("bridge_schema_changes",
                                      "Schemas (re)published to KV", registry=r)
        self.in_flight = Gauge("bridge_in_flight_messages",
                               "Messages published but not yet acknowledged", registry=r)
        self.duplicate_conflicts = Counter(
            "bridge_duplicate_conflicts", "Message ids JetStream held with other content than "
            "the change sent (taken by someone else); each change stored again under a new id",
            registry=r)
        self.publish_latency = Histogram(
            "bridge_publish_latency_seconds", "Publish-to-PubAck latency per ack batch",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10), registry=r)
        self.commit_to_stored = Histogram(
            "bridge_commit_to_stored_seconds", "PostgreSQL commit time to JetStream PubAck",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                     30, 60), registry=r)
        # plain values for /status (gauges hold floats; LSNs are printed as LSNs)
        self.confirmed_lsn = 0
        self.current_lsn = 0
        self.last_resync_lost_after: int | None = None

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, metric) -> float:
        """The current value of one of these counters or gauges."""
        return metric._value.get()  # prometheus_client has no public getter

    def status(self) -> dict:
        connected = bool(self.value(self.connected))
        return {
            "status": "connected" if connected else "disconnected",
            "uptime_seconds": int(time.monotonic() - self.started),
            "wal_messages_received": int(self.value(self.wal_messages)),
            "cdc_events_published": int(self.value(self.events_published)),
            "current_lsn": format_lsn(self.current_lsn),
            "confirmed_lsn": format_lsn(self.confirmed_lsn),
            "is_connected": connected,
            "nats_connected": bool(self.value(self.nats_connected)),
            "reconnect_count": int(self.value(self.reconnects)),
            "nats_reconnect_count": int(self.value(self.nats_reconnects)),
            "last_processing_time_us": self.value(self.last_processing_time_us),
            "slot_active": bool(self.value(self.slot_active)),
            "wal_lag_bytes": int(self.value(self.wal_lag_bytes)),
            "wal_lag_mb": int(self.value(self.wal_lag_bytes)) // (1024 * 1024),
            "in_flight_messages": int(self.value(self.in_flight)),
            "duplicate_conflicts": int(self.value(self.duplicate_conflicts)),
            "slot_resyncs": int(self.value(self.resyncs)),
            "last_resync_lost_after": (None if self.last_resync_lost_after is None
                                       else format_lsn(self.last_resync_lost_after)),
        }

    def readiness(self) -> dict:
        """``/health/ready``: ready only while streaming from PostgreSQL and connected to NATS."""
        postgres, nats = bool(self.value(self.connected)), bool(self.value(self.nats_connected))
        return {"status": "ready" if postgres and nats else "not ready",
                "postgres_streaming": postgres, "nats_connected": nats}

    def logfmt(self) -> str:
        s = self.status()
        return (f"METRICS uptime={s['uptime_seconds']} wal_messages={s['wal_messages_received']}"
                f" cdc_events={s['cdc_events_published']} lsn={s['confirmed_lsn']}"
                f" connected={int(s['is_connected'])} reconnects={s['reconnect_count']}"
                f" nats_reconnects={s['nats_reconnect_count']} lag_bytes={s['wal_lag_bytes']}"
                f" slot_active={int(s['slot_active'])} in_flight={s['in_flight_messages']}")


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` of them: one more is answered 503
    and closed at once (400 idle connections held 400 threads)."""

    daemon_threads = True
    request_queue_size = 128  # (listen backlog: a burst is accepted, then answered or refused)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class TelemetryServer:
    """``/metrics``, ``/status``, ``/health/live``, ``/health/ready`` (= ``/health``);
    ``POST /shutdown`` only with a token. ``loop`` is the bridge's event loop, for liveness."""

    def __init__(self, metrics: BridgeMetrics, *, host: str = "127.0.0.1", port: int = 9090,
                 admin_token: str | None = None,
                 on_shutdown: Callable[[], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.metrics = metrics
        telemetry = self
        expected_authorization = f"Bearer {admin_token}".encode()

        class Handler(BaseHTTPRequestHandler):
            timeout = IDLE_TIMEOUT  # (stdlib name: the connection's socket timeout)

            def log_message(self, format: str, *args) -> None:  # (stdlib names)
                log.debug("telemetry: " + format, *args)

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, value: dict) -> None:
                self._send(code, json.dumps(value).encode(), "application/json")

            def do_GET(self) -> None:  # (stdlib name)
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._send(200, telemetry.metrics.exposition(), CONTENT_TYPE_LATEST)
                elif path == "/status":
                    self._json(200, telemetry.metrics.status())
                elif path == "/health/live":
                    live = loop is None or _loop_responds(loop)
                    self._json(200 if live else 503,
                               {"status": "live" if live else "event loop stalled"})
                elif path in ("/health", "/health/ready"):
                    ready = telemetry.metrics.readiness()
                    self._json(200 if ready["status"] == "ready" else 503, ready)
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:  # (stdlib name)
                # (http.server reads headers as latin-1: compare bytes, whatever was sent)
                given = self.headers.get("Authorization", "").encode("latin-1", "replace")
                if self.path != "/shutdown":
                    self._json(404, {"error": "not found"})
                elif admin_token is None or on_shutdown is None:
                    self._json(403, {"error": "admin actions are disabled (set "
                                              "CDC_ADMIN_TOKEN to enable)"})
                elif not hmac.compare_digest(given, expected_authorization):
                    self._json(401, {"error": "bad or missing token"})
                else:
                    self._json(202, {"status": "shutting down"})
                    on_shutdown()

        try:
            self._server = _BoundedHTTPServer((host, port), Handler)
        except OSError as exc:
            raise CdcError(f"cannot serve telemetry on {host}:{port} ({exc.strerror}): set "
                           "CDC_HTTP_PORT to a free port (0: any free port)") from None
        # polled every 0.1 s (not 0.5): stop() waits for the poll, inside the shutdown budget
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,),
                                        name="telemetry-http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _loop_responds(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` runs a no-op within ``LOOP_TIMEOUT`` (from another thread)."""
    if loop.is_closed():
        return False
    answered = threading.Event()
    try:
        loop.call_soon_threadsafe(answered.set)
    except RuntimeError:  # closed meanwhile
        return False
    return answered.wait(LOOP_TIMEOUT)
