"""What the mirror raises when it cannot go on as it is."""

from __future__ import annotations

from cdc_platform.errors import CdcError


class MirrorError(CdcError):
    """The mirror cannot go on as it is: a corrupt database, an unmappable schema."""


class DivergenceError(MirrorError):
    """A change does not fit the mirrored rows (a missing row, a duplicate key, a column or
    a value the table cannot hold): the mirror no longer equals the source and must bootstrap
    that table again."""

    table: str | None = None  # set for a batch flushed at commit (no event names it there)


class SchemaNotMirrorable(MirrorError):
    """A snapshot's schema that SQLite cannot hold (two columns differing only in case, a
    column it cannot map): its table waits for the next schema; the others go on."""
