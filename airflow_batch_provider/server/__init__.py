"""The local batch server: an OpenAI-compatible Files + Batches API for development, tests and demos.

``config.ServerConfig`` holds the settings, ``app.create_app`` builds the FastAPI app,
``background.BackgroundServer`` runs it in a thread, and ``cli`` wires ``airflow-batch serve``.
Modules are imported on demand so the CLI stays light.
"""

from __future__ import annotations
