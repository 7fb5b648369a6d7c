"""Shared test set-up.

Without a GPU the device kernels run in numba's CUDA simulator.  numba reads
``NUMBA_ENABLE_CUDASIM`` when its config is first imported, which a plugin
may already have done, so set it and re-read the config here, before any test
module imports ``numba.cuda``.
"""
import os
import shutil

if not os.environ.get("COMMLIB_REAL_GPU") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    import numba.core.config

    numba.core.config.reload_config()
