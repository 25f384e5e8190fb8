"""How rows come back from a PostgreSQL ledger, and how Python values go to it: what
makes a ``PgConnection`` (ledger/db_postgresql.py) read like an ``sqlite3`` one."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.adapt import Dumper


class Row(tuple[Any, ...]):
    """A result row read by position or by column name, like ``sqlite3.Row``."""

    __slots__ = ()
    _index: dict[str, int] = {}

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


@functools.lru_cache(maxsize=1024)
def _row_class(names: tuple[bytes, ...]) -> type[Row]:
    return type("Row", (Row,), {"__slots__": (),
                                "_index": {n.decode(): i for i, n in enumerate(names)}})


def has_columns(cursor: psycopg.Cursor[Any]) -> bool:
    result = cursor.pgresult
    return result is not None and result.nfields > 0


def row_factory(cursor: Any) -> Callable[[Sequence[Any]], Any]:
    # The result's field names, read as they came: ``cursor.description`` would build a
    # Column object per column for every statement (measured: a quarter of the client
    # CPU of a claim, whose SELECT * reads 34 columns).
    if not has_columns(cursor):
        return tuple
    result = cursor.pgresult
    return _row_class(tuple(result.fname(i) for i in range(result.nfields)))


class BoolAsUnknown(Dumper):
    """Python booleans go as untyped '1'/'0': SQLite's ledger stores them in INTEGER
    columns and also tests them in CASE WHEN; PostgreSQL reads '1' as either."""

    oid = 0

    def dump(self, obj: Any) -> bytes:
        return b"1" if obj else b"0"
