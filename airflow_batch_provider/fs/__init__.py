"""Object-storage filesystems this provider registers for ``ObjectStoragePath`` (see ``fs/gcs.py``)."""
