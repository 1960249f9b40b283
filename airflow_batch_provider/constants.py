"""Names the provider shares across modules and with users' connections; imports nothing.

Each is spelled once here so a hook, an operator and a server cannot drift apart.
"""

from __future__ import annotations

#: Connection id every hook, operator, sensor and trigger uses unless told otherwise.
DEFAULT_CONN_ID = "batch_api_default"
#: Airflow connection type of the Batch API hook.
CONN_TYPE = "batch_api"
#: Batch metadata key naming the shard a batch was submitted for (set at submit, read at merge).
SHARD_TAG = "airflow_shard"
#: The batch metadata key carrying the shard's fingerprint (a Vertex AI label holds its first 63
#: characters). Here, not in submission.py, so a dialect can name it without loading pydantic.
FINGERPRINT_NAME = "airflow_fingerprint"
