"""The merge's write plan: how rows reach the results table, decided once before any is written.

:func:`plan_write` is a pure function of facts: what the database can do (its SQL dialect's
:class:`~airflow_batch_provider.warehouse.databases.Capabilities`) and what the table looks like
(its columns and unique keys, or that it does not exist). The writer dispatches on the
:class:`WritePlan` it returns and never changes it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from airflow_batch_provider.exceptions import WarehouseSchemaError
from airflow_batch_provider.warehouse.databases import Capabilities


class WriteMode(str, Enum):
    """How the merge's rows are written."""

    #: A plain INSERT into the table this merge created: it is empty and held alone.
    INSERT = "insert"
    #: DELETE the keys about to be written, then INSERT (a table with no columns of its own).
    REPLACE = "replace"
    #: UPDATE the rows whose keys exist, then INSERT the others (no unique key needed).
    UPDATE_INSERT = "update_insert"
    #: One INSERT that updates the rows whose keys exist (ON CONFLICT / ON DUPLICATE KEY).
    UPSERT = "upsert"


@dataclass(frozen=True)
class WritePlan:
    """How one merge writes.

    :param mode: see :class:`WriteMode`.
    :param create_table: the table does not exist: the merge creates it first.
    :param key_in_create: the created table has its primary key in ``CREATE TABLE``.
    :param key_after_load: the created table gets its primary key once every row is written
        (building the index once is cheaper than growing it row by row, and a repeated key
        still fails, and can be undone, before commit).
    :param check_repeated_keys: keys.jsonl is checked for two lines with one key before writing,
        because nothing in a keyless table would refuse them.
    :param add_columns: columns of a later release that the existing table lacks: the merge adds
        them (nullable) before writing, so a table created by an earlier version keeps working.
    """

    mode: WriteMode
    create_table: bool = False
    key_in_create: bool = False
    key_after_load: bool = False
    check_repeated_keys: bool = False
    add_columns: tuple[str, ...] = ()


def plan_write(
    capabilities: Capabilities,
    *,
    table: str,
    columns: Collection[str] | None,
    unique_keys: Sequence[frozenset[str]] | None,
    target_columns: Sequence[str],
    target_keys: Sequence[str],
    create_table: bool,
    addable_columns: Collection[str] = (),
) -> WritePlan:
    """Decide how to write into ``table``.

    :param capabilities: the database's.
    :param table: the quoted table name (for messages).
    :param columns: the table's column names, or None when it does not exist.
    :param unique_keys: column sets of its primary key and unique indexes; None when not known.
    :param target_columns: the columns the merge writes.
    :param target_keys: the columns it upserts by.
    :param create_table: whether a missing table may be created.
    :param addable_columns: target columns an existing table may lack: they are added, not refused.
    :raises WarehouseSchemaError: the table is missing (and may not be created), lacks columns,
        or has no unique key on exactly ``target_keys`` where the upsert needs one.
    """
    caps = capabilities
    # Nothing in a keyless table, or one whose key is not enforced, refuses two rows for one key.
    check = caps.keyless_tables or not caps.enforces_unique_keys
    upsert = WriteMode.UPDATE_INSERT if caps.upsert_by_update else WriteMode.UPSERT
    if columns is None:
        if not create_table:
            raise WarehouseSchemaError(f"table {table} does not exist and create_table is False")
        after_load = caps.savepoints and caps.exclusive_merge
        return WritePlan(
            # Only a merge that holds the table alone knows the new table is still empty.
            mode=WriteMode.INSERT if caps.exclusive_merge else upsert,
            create_table=True,
            key_in_create=not after_load and not caps.keyless_tables,
            key_after_load=after_load,
            check_repeated_keys=check,
        )
    have = {name.lower() for name in columns}
    addable = {c.lower() for c in addable_columns}
    absent = [c for c in target_columns if c.lower() not in have]
    add = tuple(c for c in absent if c.lower() in addable)
    missing = [c for c in absent if c.lower() not in addable]
    if missing:
        raise WarehouseSchemaError(
            f"table {table} exists but lacks column(s) {', '.join(repr(m) for m in missing)}; "
            f"add them or merge into a new table"
        )
    # Replacing rows is only the same as updating them when the table has no columns of its
    # own, whose values an update keeps.
    have |= {c.lower() for c in add}
    replace = caps.upsert_by_replace and have == {c.lower() for c in target_columns}
    if replace and caps.keyless_tables:
        # Rows are replaced by key (see keyless_tables): no unique index is needed.
        return WritePlan(WriteMode.REPLACE, check_repeated_keys=check, add_columns=add)
    keys = frozenset(target_keys)
    if caps.keyless_tables and (unique_keys is None or keys not in unique_keys):
        # A table the merge created (no key) and then given columns of its own: update the
        # rows by key, keeping those columns' values, and insert the new keys.
        return WritePlan(WriteMode.UPDATE_INSERT, check_repeated_keys=check, add_columns=add)
    if unique_keys is not None and keys not in unique_keys:
        raise WarehouseSchemaError(
            f"table {table} has no primary key or unique index on exactly "
            f"({', '.join(target_keys)}); the merge upserts by these columns, so re-runs would "
            f"duplicate rows: add one, or merge into a new table"
        )
    return WritePlan(WriteMode.REPLACE if replace else upsert, check_repeated_keys=check, add_columns=add)
