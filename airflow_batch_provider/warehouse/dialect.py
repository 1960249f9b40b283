"""Old import path of the warehouse SQL dialects, kept while callers move to ``warehouse.databases``.

New code imports :mod:`airflow_batch_provider.warehouse.databases`; nothing is defined here.
"""

from __future__ import annotations

from airflow_batch_provider.warehouse.databases import SqlDialect as WarehouseDialect
from airflow_batch_provider.warehouse.databases import get_sql_dialect as get_warehouse_dialect

__all__ = ["WarehouseDialect", "get_warehouse_dialect"]
