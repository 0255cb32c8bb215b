"""Demo tables and a trickle of writes for the dev stack (the "application" side)."""

from __future__ import annotations

import logging
import random
import threading

import psycopg
from psycopg.types.json import Jsonb

log = logging.getLogger(__name__)

DEMO_TABLES = ("users", "orders")

_DDL = """
CREATE TABLE IF NOT EXISTS users (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL,
    email       text UNIQUE,
    score       numeric(10, 2),
    tags        text[],
    profile     jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz
);
CREATE TABLE IF NOT EXISTS orders (
    id          bigserial PRIMARY KEY,
    user_id     bigint NOT NULL,
    amount      numeric(12, 2) NOT NULL,
    status      text NOT NULL DEFAULT 'new',
    placed_at   timestamptz NOT NULL DEFAULT now()
);
"""

_TAGS = ["alpha", "beta", "edge", "vip", "new", "has,comma", 'has"quote', None]


def create_demo_tables(conn: psycopg.Connection) -> None:
    conn.execute(_DDL)
    if conn.execute("SELECT count(*) FROM users").fetchone() == (0,):
        conn.execute(
            "INSERT INTO users (name, email, score, tags, profile) "
            "SELECT 'user-' || i, 'user' || i || '@example.com', (i * 1.25)::numeric(10,2), "
            "ARRAY['seed', NULL], jsonb_build_object('level', i % 5) "
            "FROM generate_series(1, 100) AS i"
        )


class DemoWorkload:
    """Inserts, updates and deletes a few rows per second until stopped."""

    def __init__(self, conninfo: str, writes_per_second: float) -> None:
        self._conninfo = conninfo
        self._interval = 1.0 / writes_per_second if writes_per_second > 0 else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-workload", daemon=True)

    def start(self) -> None:
        if self._interval is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        rng = random.Random()
        try:
            with psycopg.connect(self._conninfo, autocommit=True) as conn:
                while not self._stop.wait(self._interval):
                    self._write_once(conn, rng)
        except psycopg.Error as exc:  # the server going away ends the demo, not the stack
            if not self._stop.is_set():
                log.warning("demo workload stopped: %s", exc)

    @staticmethod
    def _write_once(conn: psycopg.Connection, rng: random.Random) -> None:
        action = rng.random()
        if action < 0.5:
            user_id = conn.execute(
                "INSERT INTO users (name, email, score, tags, profile) "
                "VALUES (%s, %s, %s, %s, %s) RETURNING id",
                (f"user-{rng.randrange(10**9)}", None, round(rng.uniform(0, 1000), 2),
                 rng.sample(_TAGS, 2), Jsonb({"level": rng.randrange(5)})),
            ).fetchone()[0]  # type: ignore[index]  # (RETURNING: always a row)
            conn.execute("INSERT INTO orders (user_id, amount) VALUES (%s, %s)",
                         (user_id, round(rng.uniform(1, 500), 2)))
        elif action < 0.85:
            conn.execute(
                "UPDATE users SET score = score + 1, updated_at = now() "
                "WHERE id = (SELECT id FROM users ORDER BY random() LIMIT 1)")
            conn.execute(
                "UPDATE orders SET status = 'paid' "
                "WHERE id = (SELECT id FROM orders WHERE status = 'new' LIMIT 1)")
        else:
            conn.execute(
                "DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)")
