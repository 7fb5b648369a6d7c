"""Shared test set-up.

Without a GPU the device kernels run in numba's CUDA simulator; the variable
must be set before numba.cuda is first imported, hence here.
"""
import os
import shutil

if not os.environ.get("COMMLIB_REAL_GPU") and shutil.which("nvidia-smi") is None:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
