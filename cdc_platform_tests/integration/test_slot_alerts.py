"""Early warnings before a slot is lost, read from a real server whose slot falls behind
max_slot_wal_keep_size (wal_status and safe_wal_size, not only the lag)."""

from __future__ import annotations

import psycopg

from cdc_platform.dev.servers import start_logical_postgres
from cdc_platform.replication.slots import read_slot, slot_alerts

MB = 2**20


def _alerts(state, safe_wal_warn=256 * MB):
    # lag thresholds far away: only what wal_status and safe_wal_size say
    return slot_alerts(state, lag_warn=2**40, lag_critical=2**41, safe_wal_warn=safe_wal_warn)


def test_a_slot_falling_behind_warns_before_it_is_lost(server_dir):
    server = start_logical_postgres(server_dir / "pg", unsafe_no_fsync=True)
    try:
        with psycopg.connect(server.superuser_conninfo(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '64MB'")
            conn.execute("ALTER SYSTEM SET max_wal_size = '32MB'")
            conn.execute("ALTER SYSTEM SET min_wal_size = '32MB'")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("SELECT pg_create_logical_replication_slot('behind', 'pgoutput')")
            conn.execute("CREATE TABLE filler (payload text)")
            fresh = read_slot(conn, "behind")
            assert fresh.wal_status == "reserved" and fresh.safe_wal_size is not None
            assert _alerts(fresh, safe_wal_warn=1) == []  # nothing to say yet
            seen = {fresh.wal_status}
            warned_before_lost = False
            for _ in range(12):  # ~16 MB of WAL per round, never consumed
                conn.execute("INSERT INTO filler SELECT repeat('x', 1000) "
                             "FROM generate_series(1, 14000)")
                conn.execute("SELECT pg_switch_wal()")
                state = read_slot(conn, "behind")
                seen.add(state.wal_status)
                if state.wal_status == "lost":
                    break
                alerts = _alerts(state)
                if state.wal_status == "unreserved":
                    assert alerts[0][0] == "critical" and "unreserved" in alerts[0][1]
                    warned_before_lost = True
                    conn.execute("CHECKPOINT")  # what PostgreSQL does next: the slot is lost
                elif state.safe_wal_size < 256 * MB:
                    assert any("safe_wal_size" in message for _, message in alerts)
                    warned_before_lost = True
            assert warned_before_lost and "lost" in seen, seen
            assert read_slot(conn, "behind").lost
    finally:
        server.stop()
