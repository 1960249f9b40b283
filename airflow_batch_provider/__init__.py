"""Apache Airflow provider for LLM batch inference over OpenAI-compatible Batch APIs."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
