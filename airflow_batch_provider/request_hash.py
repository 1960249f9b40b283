"""``request_hash``: one stable name for a canonical request, whatever the vendor.

The hash is taken over the canonical (OpenAI-shaped) request the build stages -- its endpoint
and its body, which holds the model -- written as JSON with sorted keys, never over a vendor's
encoding of it. So the same row gives the same hash through every dialect, in every process
and on every run, and a changed prompt, model or parameter gives a new one.

It is the first 32 hex characters (128 bits) of the SHA-256: half the width of the full digest
in every results row and ``keys.jsonl`` line, and still far from a collision (about 1 in 10^20
for a billion requests). Incremental runs (``skip_unchanged``) and deduplicated runs
(``deduplicate``) compare requests by it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

#: Hex characters kept of the SHA-256 (128 bits).
HASH_CHARS = 32
_SORTED = orjson.OPT_SORT_KEYS


def request_hash(url: str, body: Mapping[str, Any]) -> str:
    """The hash of the canonical request ``url`` + ``body`` (the body names the model).

    :param url: the endpoint the line targets, e.g. ``/v1/chat/completions``.
    :param body: the canonical request body.
    :raises orjson.JSONEncodeError: the body holds a value JSON cannot hold (the build has
        already refused such a line).
    """
    data = orjson.dumps({"url": url, "body": body}, option=_SORTED)
    return hashlib.sha256(data).hexdigest()[:HASH_CHARS]
