from collections.abc import Callable, Collection
from typing import Any

class RowBuilder:
    def __init__(
        self, names: tuple[str, ...], converters: tuple[Callable[[str], Any], ...],
        indexes: tuple[int, ...], passthrough: Collection[Any], slow: type[Exception],
    ) -> None: ...
    def __call__(self, values: tuple[Any, ...]) -> dict[str, Any]: ...

def take_changes(
    raw: list[Any], index: int, tables: dict[int, Any], record_type: Any, commit_lsn: int,
    xid: int, commit_ts: Any, ordinal: int, events: list[Any], unchanged: object,
) -> tuple[int, int, int]: ...
