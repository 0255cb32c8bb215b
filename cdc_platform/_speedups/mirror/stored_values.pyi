from collections.abc import Iterable, Sequence
from typing import Any

from cdc_platform.mirror import stored_values as _pure
from cdc_platform.mirror.columns import MirroredColumn
from cdc_platform.wire.digest import TableDigest

def wire_value(stored: Any, column: MirroredColumn) -> Any: ...

# Typed as the pure class (whose name the twin takes) so that the pure module can bind it.
class StoredRowDigester(_pure.StoredRowDigester):
    columns: tuple[MirroredColumn, ...]
    names: tuple[str, ...]
    def __init__(self, columns: Sequence[MirroredColumn], key_columns: Sequence[str]) -> None: ...
    def hashes(self, stored: Sequence[Any]) -> tuple[int, int]: ...

def digest_stored_rows(digest: TableDigest, digester: _pure.StoredRowDigester,
                       rows: Iterable[Sequence[Any]]) -> int: ...
