"""A mirror bootstrapped from a real Spark snapshot (zstd with a dictionary) equals the source,
value for value, read back from SQLite."""

from __future__ import annotations

import math
import time

import pytest

from cdc_platform.consumer.snapshots import SnapshotUnusable, cutover_start_seq, latest_meta
from cdc_platform.mirror.columns import TableShape, quote, to_sqlite
from cdc_platform.mirror.snapshots import BootstrapProgress, read_chunks
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.postgres.catalog import table_schema
from cdc_platform.snapshot import snapshot_table
from cdc_platform_tests.fixtures.services import random_name
from cdc_platform_tests.fixtures.snapshots import (
    NO_BRIDGE,
    TYPES_COLUMNS,
    create_types_table,
    direct_rows,
    settings_for,
)

pytestmark = pytest.mark.spark


def _comparable(value):
    """NaN != NaN in Python: compare a NaN as its stored text."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_bootstrap_from_a_compressed_snapshot_equals_the_source(
        fmt, pg_admin, cdc_database, provisioned_nats, nats_client, spark_session, tmp_path):
    table = random_name("mirror_types")
    create_types_table(pg_admin, table, 5_000)
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, format=fmt, zstd=True,
                            chunk_rows=500)
    result = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE)
    js = nats_client.jetstream()

    meta = await latest_meta(js, table)
    assert meta is not None and meta.snapshot_id == result.snapshot_id
    assert meta.batch_count == result.batch_count > 5
    # no bridge ran: no marker in CDC, so no cutover point a mirror could follow from
    with pytest.raises(SnapshotUnusable, match="watermark marker"):
        await cutover_start_seq(js, meta)

    schema = table_schema(pg_admin, cdc_database.publication, "public", table)
    shape = TableShape.from_schema(schema.to_wire())
    store = MirrorStore(tmp_path / "mirror.db")
    store.begin_bootstrap(shape, meta.snapshot_id, meta.lsn)
    progress = BootstrapProgress(table, meta.row_count, meta.batch_count, time.monotonic())
    columns = tuple(c.name for c in shape.columns)
    async for chunk in read_chunks(js, meta, progress=progress.update,
                                   columns=columns if fmt == "msgpack" else None):
        if chunk.as_tuples:  # (the compiled decoder; the pure path gives row maps)
            store.load_tuples(table, columns, chunk.rows, has_nan=chunk.has_nan)
        else:
            store.load_rows(table, chunk.rows if fmt == "msgpack"
                            else [shape.from_json(r) for r in chunk.rows])
    store.finish_bootstrap(table, stream_seq=0)
    assert progress.rows == 5_000 and progress.chunks == meta.batch_count
    assert "5000/5000 rows" in progress.line()

    mirrored = store._db.execute(
        f"SELECT {', '.join(quote(c) for c in TYPES_COLUMNS)} FROM {quote(table)} "
        "ORDER BY id").fetchall()
    source = sorted(direct_rows(cdc_database.server.superuser_conninfo(), table, TYPES_COLUMNS),
                    key=lambda row: row["id"])
    assert len(mirrored) == len(source) == 5_000
    for got, row in zip(mirrored, source, strict=True):
        assert [_comparable(v) for v in got] == [_comparable(to_sqlite(row[c]))
                                                 for c in TYPES_COLUMNS]
    by_id = {row[0]: row for row in mirrored}
    f8 = TYPES_COLUMNS.index("f8")
    assert by_id[53][f8] == 0.0 and math.copysign(1.0, by_id[53][f8]) == -1.0  # -0.0 kept
    assert by_id[50][f8] == "NaN" and by_id[51][f8] == math.inf
    store.close()
