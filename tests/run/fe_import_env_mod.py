"""Imported by a worker (or preloaded): changes the environment at import, as torch and
Lightning do (``TORCHINDUCTOR_CACHE_DIR``, ``PYTORCH_NVML_BASED_CUDA_CHECK=1``)."""

import os

os.environ.setdefault("FE_IMPORT_DEFAULT", "from-import")
os.environ["FE_IMPORT_FORCED"] = "from-import"
os.environ.pop("FE_IMPORT_REMOVED", None)
os.environ.setdefault("LOCAL_RANK", "from-import")  # the worker's own value must win
