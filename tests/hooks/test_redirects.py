"""Where a file's redirect may lead (``hooks.redirects.refusal``): one row per kind of target.

The hostile-server tests (tests/hooks/test_hostile.py) drive the same rule through both clients.
"""

from __future__ import annotations

import ipaddress

import httpx
import pytest

from airflow_batch_provider.hooks.redirects import refusal

ALLOWED = None


@pytest.mark.parametrize(
    ("url", "addresses", "allow_private", "expected"),
    [
        # Public https: followed, whatever the path and query.
        ("https://bucket.s3.amazonaws.com/o?sig=1", ["52.216.1.1"], False, ALLOWED),
        ("https://[2600:1f18::1]/o", ["2600:1f18::1"], False, ALLOWED),
        # Loopback stays allowed, http or https (the local batch server, the tests' stores).
        ("http://127.0.0.1:8000/o", ["127.0.0.1"], False, ALLOWED),
        ("https://localhost/o", ["127.0.0.1", "::1"], False, ALLOWED),
        ("http://[::ffff:127.0.0.1]/o", ["::ffff:127.0.0.1"], False, ALLOWED),
        # Plain http to anything else: refused (a signed URL must not cross the wire in clear).
        ("http://bucket.example.com/o", ["52.216.1.1"], False, "plain http"),
        ("http://bucket.example.com/o", ["52.216.1.1"], True, "plain http"),
        # Private, shared, link-local and metadata addresses, as literals or behind a name.
        ("https://10.1.2.3/o", ["10.1.2.3"], False, "a private address"),
        ("https://172.31.0.1/o", ["172.31.0.1"], False, "a private address"),
        ("https://192.168.0.10/o", ["192.168.0.10"], False, "a private address"),
        ("https://100.100.100.200/o", ["100.100.100.200"], False, "a private address"),
        ("https://[fd12::1]/o", ["fd12::1"], False, "a private address"),
        ("https://[::ffff:10.0.0.1]/o", ["::ffff:10.0.0.1"], False, "a private address"),
        ("https://0.0.0.0/o", ["0.0.0.0"], False, "a private address"),
        ("https://169.254.1.1/o", ["169.254.1.1"], False, "a link-local address"),
        ("https://[fe80::1]/o", ["fe80::1"], False, "a link-local address"),
        ("https://169.254.169.254/o", ["169.254.169.254"], False, "an instance-metadata address"),
        ("https://[fd00:ec2::254]/o", ["fd00:ec2::254"], False, "an instance-metadata address"),
        ("https://metadata.google.internal/o", ["169.254.169.254"], False, "an instance-metadata host"),
        ("https://METADATA.google.internal./o", [], False, "an instance-metadata host"),
        # One private address among public ones is enough to refuse (DNS answers can be mixed).
        ("https://files.example.com/o", ["52.1.1.1", "10.0.0.7"], False, "resolves to 10.0.0.7, a private"),
        # The connection allows private targets: followed, over http too.
        ("https://10.1.2.3/o", ["10.1.2.3"], True, ALLOWED),
        ("http://minio.internal:9000/o", ["10.0.0.7"], True, ALLOWED),
        ("https://169.254.169.254/o", ["169.254.169.254"], True, ALLOWED),
        ("https://metadata.google.internal/o", ["169.254.169.254"], True, ALLOWED),
    ],
)
def test_redirect_target_decision(
    url: str, addresses: list[str], allow_private: bool, expected: str | None
) -> None:
    found = refusal(httpx.URL(url), [ipaddress.ip_address(a) for a in addresses], allow_private=allow_private)
    if expected is None:
        assert found is None
    else:
        assert found is not None and found.startswith(expected), found
