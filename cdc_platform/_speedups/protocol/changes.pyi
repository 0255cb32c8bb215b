from collections.abc import Callable, Collection
from typing import Any

from cdc_platform.protocol.changes import CachedRelation, ChangeRecord, Event
from cdc_platform.protocol.pgoutput import TupleData

class RowBuilder:
    def __init__(
        self, names: tuple[str, ...], converters: tuple[Callable[[str], Any], ...],
        indexes: tuple[int, ...], passthrough: Collection[object], slow: type[Exception],
    ) -> None: ...
    def __call__(self, values: TupleData) -> dict[str, Any]: ...

row_builder = RowBuilder

def take_changes(
    raw: list[bytes], index: int, tables: dict[int, CachedRelation],
    record_type: type[ChangeRecord], commit_lsn: int, xid: int, commit_ts: str, ordinal: int,
    events: list[Event], unchanged: object,
) -> tuple[int, int, int]: ...
