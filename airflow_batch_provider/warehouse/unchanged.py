"""``skip_unchanged``: each source row's last answered request, read from the results table.

A build with ``skip_unchanged=True`` leaves out the rows whose key already has a ``succeeded``
row with the same ``request_hash`` in the merge's target table. The hash is computed in Python
from the rendered body, so the warehouse cannot compare it by itself; what it gives is the
target's hash for each source row, which the build's row loop compares with the hash it computes
(``rows_to_lines``). Two ways, both streaming with flat memory:

* ``join`` (source and target on one connection): the source query is wrapped in a
  ``LEFT JOIN`` of the target on the key columns (``status = 'succeeded'``), so each streamed
  row arrives with the target's hash as one extra, last column. The database joins (by hash
  or by the target's primary key); Python holds nothing more than the fetched batch.
* ``lookup`` (the target elsewhere): per fetched batch of source rows, the target's hashes of
  those keys are read by key (``IN`` lists of at most ``LOOKUP_KEYS`` keys, through the
  target's primary key), matched back by custom_id; memory is one batch's keys.

Either way the rows leave as the query's rows plus the previous hash (None: nothing to skip).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from airflow_batch_provider import keys as keymod
from airflow_batch_provider.warehouse.databases import get_sql_dialect

if TYPE_CHECKING:
    from airflow_batch_provider.warehouse.read import Column, RowStream

#: The extra column of a joined source query (the target's hash of the row's last answer).
PREVIOUS_COLUMN = "abp_previous_request_hash"
#: Keys per lookup statement (SQLite's default limit is 999 bound parameters per statement).
LOOKUP_KEYS = 400
LOOKUP_CHOICES = ("auto", "join", "lookup")


def target_has_hashes(hook: Any, table: str, schema: str | None) -> list[str] | None:
    """The target's columns when it exists and has ``request_hash`` (so it can say what is
    unchanged), else None."""
    dialect = get_sql_dialect(hook)
    conn = hook.get_conn()
    try:
        columns = dialect.probe_columns(conn, table, schema)
    finally:
        _close(conn)
    if columns is None or "request_hash" not in columns:
        return None
    return list(columns)


def joined_query(hook: Any, query: str, table: str, schema: str | None, key_columns: Sequence[str]) -> str:
    """``query`` with the target's hash of each row's succeeded answer as a last column.

    :param hook: the connection both the source and the target are on.
    :param query: the source query (any SELECT; its parameters stay as they are).
    :param table: the results table; ``schema`` its schema.
    :param key_columns: the key columns, named alike in the source and the target.
    """
    d = get_sql_dialect(hook)
    q = d.quote
    body = query.strip().rstrip(";").rstrip()
    on = " AND ".join(f"abp_t.{q(k)} = abp_s.{q(k)}" for k in key_columns)
    return (
        f"SELECT abp_s.*, abp_t.{q('request_hash')} AS {q(PREVIOUS_COLUMN)} FROM ({body}) abp_s "
        f"LEFT JOIN {d.table(table, schema)} abp_t ON {on} AND abp_t.{q('status')} = 'succeeded'"
    )


class HashLookup:
    """The target's hash of each row's succeeded answer, read per batch by key (another database).

    :param hook: the target connection's ``DbApiHook``.
    :param table: the results table; ``schema`` its schema.
    :param key_columns: the key column names, in the target.
    :param key_index: where each key column sits in a source row.
    """

    def __init__(
        self, hook: Any, table: str, schema: str | None, key_columns: Sequence[str], key_index: Sequence[int]
    ) -> None:
        self.hook = hook
        self.dialect = get_sql_dialect(hook)
        self.key_columns = list(key_columns)
        self.key_index = list(key_index)
        q = self.dialect.quote
        self._select = (
            f"SELECT {', '.join(q(k) for k in key_columns)}, {q('request_hash')} "
            f"FROM {self.dialect.table(table, schema)} WHERE {q('status')} = 'succeeded' AND "
        )
        self._conn: Any = None
        #: Statements run so far (for the log and the tests).
        self.statements = 0

    def _where(self, count: int) -> str:
        p = self.dialect.placeholder
        q = self.dialect.quote
        if len(self.key_columns) == 1:
            return f"{q(self.key_columns[0])} IN ({', '.join([p] * count)})"
        one = "(" + " AND ".join(f"{q(k)} = {p}" for k in self.key_columns) + ")"
        return "(" + " OR ".join([one] * count) + ")"

    def hashes(self, rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
        """``rows`` each with the target's hash (or None) appended."""
        wanted: dict[str, list[Any]] = {}
        ids: list[str | None] = []
        for row in rows:
            values = [row[i] for i in self.key_index]
            cid = _custom_id(values)
            ids.append(cid)
            if cid is not None:
                wanted[cid] = values
        found: dict[str, Any] = {}
        if wanted:
            if self._conn is None:
                self._conn = self.hook.get_conn()
            keys = list(wanted.values())
            for start in range(0, len(keys), LOOKUP_KEYS):
                chunk = keys[start : start + LOOKUP_KEYS]
                params = [v for values in chunk for v in values]
                cur = self._conn.cursor()
                try:
                    cur.execute(self.dialect.bound(self._select + self._where(len(chunk))), params)
                    for *values, previous in cur.fetchall():
                        cid = _custom_id(values)
                        if cid is not None:
                            found[cid] = previous
                finally:
                    cur.close()
                self.statements += 1
        return [
            (*row, found.get(cid) if cid is not None else None) for row, cid in zip(rows, ids, strict=True)
        ]

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            _close(conn)


def _close(conn: Any) -> None:
    """End a read-only connection: roll back what it read (where a transaction is open), close."""
    with contextlib.suppress(Exception):
        conn.rollback()
    conn.close()


def _custom_id(values: Sequence[Any]) -> str | None:
    """The custom_id a key gives (equal keys of different driver types agree: 1 and Decimal(1))."""
    if any(v is None for v in values):
        return None
    try:
        return keymod.custom_id_for(values)
    except orjson.JSONEncodeError:
        return None


class UnchangedRows:
    """A source row stream whose rows carry the target's previous hash one place past the
    columns (``column_names`` and ``columns`` leave it out).

    :param rows: the open source stream (of the joined query when ``lookup`` is None).
    :param lookup: reads the hashes per batch, for a target on another connection.
    """

    def __init__(self, rows: RowStream, lookup: HashLookup | None = None) -> None:
        self.rows = rows
        self.lookup = lookup
        cols = rows.columns
        if lookup is None:
            if not cols or cols[-1].name != PREVIOUS_COLUMN:
                raise ValueError(f"the joined query's last column is not {PREVIOUS_COLUMN}")
            cols = cols[:-1]
        self.columns: list[Column] = list(cols)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def batches(self) -> Iterator[Sequence[tuple[Any, ...]]]:
        if self.lookup is None:
            yield from self.rows.batches()
            return
        for batch in self.rows.batches():
            yield self.lookup.hashes(batch)
