"""DNS rebinding: the server answers only the host names it serves, on every route."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import httpx
import pytest
from pydantic import ValidationError

from airflow_batch_provider.server import options
from airflow_batch_provider.server.config import ServerConfig

ROUTES = [
    ("GET", "/admin/faults"),
    ("GET", "/admin/stats"),
    ("GET", "/ui/batches"),
    ("GET", "/v1/files"),
    ("GET", "/v1/batches"),
    ("GET", "/health"),
    ("POST", "/v1/chat/completions"),
]


def _call(server, method: str, path: str, host: str) -> httpx.Response:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    kwargs = {"json": chat} if method == "POST" else {}
    return httpx.request(method, server.root_url + path, headers={"Host": host}, timeout=10, **kwargs)


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_a_keyless_server_refuses_a_foreign_host_on_every_route(batch_server, method, path):
    server = batch_server()
    refused = _call(server, method, path, "evil.example")
    assert refused.status_code == 421
    error = refused.json()["error"]
    assert error["code"] == "host_not_allowed"
    assert "'evil.example'" in error["message"]
    assert "--allowed-host" in error["message"]
    port = server.config.port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", "[::1]"):
        assert _call(server, method, path, host).status_code == 200, host


def test_a_rebound_page_cannot_reconfigure_the_server(batch_server):
    server = batch_server()
    before = server.admin("GET", "faults")
    refused = httpx.post(
        f"{server.root_url}/admin/faults",
        json={"rate_500": 1.0},
        headers={"Host": f"evil.example:{server.config.port}"},
        timeout=10,
    )
    assert refused.status_code == 421
    assert server.admin("GET", "faults") == before


@pytest.mark.parametrize(
    "host_line",
    [b"Host: [::1\r\n", b"Host: localhost:abc\r\n", b"Host: ::1\r\n", b"Host: \r\n", b""],
    ids=["open_bracket", "bad_port", "bare_v6", "empty", "missing"],
)
def test_a_malformed_or_missing_host_is_refused(batch_server, host_line):
    server = batch_server()
    reply = _raw(server.config.port, b"GET /admin/faults HTTP/1.0\r\n" + host_line + b"\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ")[1] == b"421", reply[:300]
    assert b"host_not_allowed" in body


def test_allowed_hosts_add_names_and_star_allows_all(batch_server):
    named = batch_server(allowed_hosts=["batch-server", "Other.Example.:8080"])
    assert _call(named, "GET", "/v1/files", "batch-server:8000").status_code == 200
    assert _call(named, "GET", "/v1/files", "other.example").status_code == 200
    assert _call(named, "GET", "/v1/files", "localhost").status_code == 200
    assert _call(named, "GET", "/v1/files", "evil.example").status_code == 421
    everyone = batch_server(allowed_hosts=["*"])
    assert _call(everyone, "GET", "/admin/faults", "evil.example").status_code == 200


def test_the_bound_address_is_served(batch_server):
    # Bound to 127.0.0.2 (still loopback), the server answers that name as well.
    server = batch_server(host="127.0.0.2")
    assert _call(server, "GET", "/health", f"127.0.0.2:{server.config.port}").status_code == 200
    assert _call(server, "GET", "/health", "127.0.0.3").status_code == 421


def test_allowed_host_option_is_repeatable_and_listed_in_help(tmp_path):
    parser = argparse.ArgumentParser()
    options.add_arguments(parser)
    args = parser.parse_args(
        ["--data-dir", str(tmp_path), "--allowed-host", "batch-server", "--allowed-host", "[::2]:80"]
    )
    assert options.config_from_args(args).allowed_hosts == ["batch-server", "::2"]
    assert options.config_from_args(parser.parse_args(["--data-dir", str(tmp_path)])).allowed_hosts == []
    help_text = subprocess.run(
        [sys.executable, "-m", "airflow_batch_provider.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--allowed-host NAME" in help_text
    assert "'*'" in help_text


@pytest.mark.parametrize("name", ["", "two words", "http://x/y", "a:b"])
def test_an_allowed_host_that_is_no_host_name_is_refused_at_start(tmp_path, name):
    with pytest.raises(ValidationError, match="allowed host"):
        ServerConfig(data_dir=tmp_path, allowed_hosts=[name])
