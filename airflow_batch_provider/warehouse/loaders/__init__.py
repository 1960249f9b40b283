"""Bulk-load engines of the warehouse SQL dialects (how rows reach a staging table fast)."""

from __future__ import annotations
