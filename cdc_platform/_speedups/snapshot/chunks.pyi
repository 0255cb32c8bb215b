from collections.abc import Callable
from typing import Any

from cdc_platform.wire.digest import RowDigester, TableDigest

ROW_KEEP: int
ROW_INT: int
ROW_FLOAT: int
ROW_BOOL: int
ROW_TIMESTAMPTZ: int
ROW_CALL: int

def pack_rows(
    fields: list[str], count: int, width: int, packed_names: tuple[bytes, ...],
    kinds: tuple[int, ...], converters: tuple[Callable[[str], Any], ...],
    unescape: Callable[[str], str],
) -> list[bytes]: ...
def digest_fields(
    digest: TableDigest, digester: RowDigester, fields: list[str], count: int, width: int,
    kinds: tuple[int, ...], converters: tuple[Callable[[str], Any], ...],
    unescape: Callable[[str], str],
) -> int: ...
def digest_block(
    digest: TableDigest, digester: RowDigester, text: str, width: int, kinds: tuple[int, ...],
    converters: tuple[Callable[[str], Any], ...], unescape: Callable[[str], str],
) -> int | None: ...
