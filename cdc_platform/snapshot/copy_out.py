"""``COPY ... TO STDOUT`` data from libpq, many rows a call.

libpq hands out one CopyData message per ``PQgetCopyData`` call, and PostgreSQL sends one row
per message: read through psycopg's ``get_copy_data`` that is a Python-level call (and a
``bytes`` object) per row, a third of a verification task's time. :func:`read_copy_data`
gathers every message libpq has received, or can read from the socket without waiting, into
one buffer; its compiled twin (``_speedups/snapshot/copy_out.pyx``) does so in C on psycopg's
own ``PGconn`` with the GIL released, so that the range tasks running in threads of one
process read (and, in ``chunks``' twin, hash) at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from psycopg.pq.abc import PGconn

from cdc_platform.speedups import compiled_twin

FILLED = 1  # the buffer holds ``limit`` bytes or more: call again for more
WAIT = 0  # nothing more until the socket is readable (then call again)
ENDED = -1  # the COPY's data has ended: its result follows (``get_result``)


def read_copy_data(pgconn: PGconn, buffer: bytearray, limit: int) -> int:
    """Append to ``buffer`` the COPY data (whole CopyData messages, in order) that libpq holds
    or reads from the socket without waiting (``PQconsumeInput`` when it holds none), until
    ``buffer`` holds ``limit`` bytes or more: :data:`FILLED`, :data:`WAIT` or :data:`ENDED`.
    At least one message is taken when one is there, whatever ``limit``. ``OperationalError``
    as psycopg's ``get_copy_data`` and ``consume_input`` raise it."""
    consumed = False  # the socket was read since the last message: nothing more there
    while True:
        nbytes, data = pgconn.get_copy_data(1)
        if nbytes > 0:
            buffer += data
            consumed = False
            if len(buffer) >= limit:
                return FILLED
        elif nbytes < 0:
            return ENDED
        elif consumed:
            return WAIT
        else:
            pgconn.consume_input()
            consumed = True


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.snapshot import copy_out as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    read_copy_data = _twin.read_copy_data
