"""Run the local batch server in a background thread (tests, benchmarks, demos)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn

from airflow_batch_provider.server.app import create_app
from airflow_batch_provider.server.config import ServerConfig


class BackgroundServer:
    """A uvicorn server for ``config`` in a daemon thread, on a free port unless one is set.

    :param config: the server settings; ``port=0`` picks a free port.
    :param startup_timeout: seconds to wait for the server to accept connections.
    """

    def __init__(self, config: ServerConfig, *, startup_timeout: float = 20.0) -> None:
        self.config = config
        self.startup_timeout = startup_timeout
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.port: int = config.port

    @property
    def base_url(self) -> str:
        """The API root in the mode's first path style (``/v1``; Azure: ``/openai/v1``)."""
        from airflow_batch_provider.server.wire import wire_class

        prefix = wire_class(self.config.dialect).path_prefixes[0]
        return f"http://{self.config.host}:{self.port}{prefix}"

    @property
    def root_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> BackgroundServer:
        if self._thread is not None:
            raise RuntimeError("server already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.port))
        self.port = sock.getsockname()[1]
        self.config = self.config.model_copy(update={"port": self.port})
        uv_config = uvicorn.Config(
            create_app(self.config),
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(uv_config)
        self._server = server

        def run() -> None:
            try:
                asyncio.run(server.serve(sockets=[sock]))
            except BaseException as exc:  # surfaced by start()/stop()
                self._error = exc
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name=f"batch-server-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"local batch server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"local batch server did not start within {self.startup_timeout}s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop the server and wait for its thread (live batches resume on the next start)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._server = None
        self._thread = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"<BackgroundServer {self.base_url} dialect={self.config.dialect} backend={self.config.backend}>"
        )

    def __getstate__(self) -> dict[str, Any]:  # pragma: no cover - never pickled with a live thread
        raise TypeError("BackgroundServer cannot be pickled")
