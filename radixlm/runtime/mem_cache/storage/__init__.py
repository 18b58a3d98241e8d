"""L3 storage backends for the hierarchical cache (see base.py for the contract)."""

from __future__ import annotations

from radixlm.runtime.mem_cache.storage.base import StorageBackend
from radixlm.runtime.mem_cache.storage.file_backend import FileStorage

# name -> factory(root or config dict, namespace, page_bytes, max_bytes=None: a size cap; a
# store that cannot keep one raises ValueError naming it); a distributed store registers here
BACKENDS = {"file": FileStorage}

__all__ = ["BACKENDS", "FileStorage", "StorageBackend"]
