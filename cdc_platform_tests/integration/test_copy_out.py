"""COPY data read from libpq many rows a call (``snapshot/copy_out.py``), by its compiled
twin (libpq's functions called in C on psycopg's own connection) and by its pure code alike,
against a real PostgreSQL: every byte in order whatever the limit, at least one row a call,
the end of the COPY, and psycopg's errors."""

from __future__ import annotations

import select
from collections.abc import Callable

import psycopg
import pytest
from psycopg.pq import ExecStatus

from cdc_platform import speedups
from cdc_platform.snapshot import copy_out
from cdc_platform.snapshot.copy_out import ENDED, FILLED, WAIT
from cdc_platform_tests.fixtures.services import random_name
from cdc_platform_tests.fixtures.twins import pure_copy

Reader = Callable[[object, bytearray, int], int]


@pytest.fixture(params=["compiled", "pure"])
def read_copy_data(request) -> Reader:
    if request.param == "pure":
        return pure_copy(copy_out.__name__).read_copy_data
    twin = speedups.compiled_twin(copy_out.__name__)
    if twin is None:
        pytest.skip("the compiled twin is not built (or pure Python asked for)")
    return twin.read_copy_data


@pytest.fixture(scope="module")
def table(postgres_server):
    """Rows with escapes, non-ASCII text, NULLs, and one row of 300 KB."""
    name = random_name("copy_out")
    with psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, note text)")
        admin.execute(f"""INSERT INTO {name} SELECT i, CASE i % 4
                              WHEN 0 THEN NULL WHEN 1 THEN E'tab\\there\\nnewline \\\\'
                              WHEN 2 THEN 'éß😀 ' || i ELSE md5(i::text) END
                          FROM generate_series(1, 3000) i""")
        admin.execute(f"INSERT INTO {name} VALUES (0, repeat('x', 300000))")
    return name


def _start_copy(conn: psycopg.Connection, table: str) -> None:
    pgconn = conn.pgconn
    pgconn.send_query(f"COPY {table} TO STDOUT".encode())
    while pgconn.is_busy():
        select.select([pgconn.socket], [], [])
        pgconn.consume_input()
    result = pgconn.get_result()
    assert result is not None and result.status == ExecStatus.COPY_OUT


def _drain(conn: psycopg.Connection, read: Reader, limit: int
           ) -> tuple[bytes, list[tuple[int, int, int]]]:
    """The COPY's bytes, and each call's (state, bytes before, bytes after)."""
    pgconn = conn.pgconn
    received, calls = bytearray(), []
    buffer = bytearray()
    while True:
        before = len(buffer)
        state = read(pgconn, buffer, limit)
        calls.append((state, before, len(buffer)))
        received += buffer
        buffer.clear()
        if state == ENDED:
            break
        if state == WAIT:
            select.select([pgconn.socket], [], [])
    while (result := pgconn.get_result()) is not None:
        assert result.status == ExecStatus.COMMAND_OK
    return bytes(received), calls


@pytest.mark.parametrize("limit", [1, 4096, 512 * 1024])
def test_every_row_comes_in_order_whatever_the_limit(postgres_server, table, read_copy_data,
                                                     limit):
    with psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True) as conn:
        with conn.cursor().copy(f"COPY {table} TO STDOUT") as copy:
            expected = b"".join(bytes(block) for block in copy)
        _start_copy(conn, table)
        received, calls = _drain(conn, read_copy_data, limit)
        assert received == expected
        assert calls[-1][0] == ENDED
        for state, _, after in calls:
            assert state in (FILLED, WAIT, ENDED)
            assert (state == FILLED) == (after >= limit) or state == ENDED
        if limit == 1:  # a row a call: each call with a buffer at the limit takes one
            assert sum(state == FILLED for state, _, _ in calls) == 3001
        # still usable after the COPY
        assert conn.execute(f"SELECT count(*) FROM {table}").fetchone() == (3001,)


def test_psycopgs_error_for_a_closed_connection(postgres_server, read_copy_data):
    conn = psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True)
    pgconn = conn.pgconn
    conn.close()
    with pytest.raises(psycopg.OperationalError,
                       match="^receiving copy data failed: connection pointer is NULL"):
        read_copy_data(pgconn, bytearray(), 1)


def test_a_failing_copy_ends_and_its_error_is_the_result(postgres_server, read_copy_data):
    """The server ending the COPY with an error (a division by zero at row 2,000) ends the
    data (ENDED) after the rows sent; the error is the COPY's result."""
    with psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True) as conn:
        pgconn = conn.pgconn
        pgconn.send_query(b"COPY (SELECT i, 1 / (2000 - i) FROM generate_series(1, 3000) i)"
                          b" TO STDOUT")
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [])
            pgconn.consume_input()
        assert pgconn.get_result().status == ExecStatus.COPY_OUT
        buffer = bytearray()
        while (state := read_copy_data(pgconn, buffer, 1 << 20)) != ENDED:
            if state == WAIT:
                select.select([pgconn.socket], [], [])
        assert buffer.count(b"\n") < 2000
        result = pgconn.get_result()
        assert result.status == ExecStatus.FATAL_ERROR
        assert b"division by zero" in result.error_message
        assert pgconn.get_result() is None
