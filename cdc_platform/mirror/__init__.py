"""The reference consumer: exact SQLite mirrors of published tables, from the wire contract."""
